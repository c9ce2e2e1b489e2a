//! Busy loops competing for the CPU, for runs that must hold on a loaded machine too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Threads spinning on the CPU until this is dropped.
pub struct BusyLoops(Arc<AtomicBool>);

impl BusyLoops {
    /// Starts `n` spinning threads.
    pub fn start(n: usize) -> BusyLoops {
        let stop = Arc::new(AtomicBool::new(false));
        for _ in 0..n {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
        }
        BusyLoops(stop)
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}
