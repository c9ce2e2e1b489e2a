//! The shim's own work on its hot paths, without any driver: what an allocation within
//! the request adds (a ledger charge and release, a record inserted and removed) and what
//! a launch adds (passing the gate). Run: `cargo bench -p gpufrac-shim`.

use std::hint::black_box;
use std::time::Instant;

use gpufrac_core::ledger::Ledger;
use gpufrac_core::records::{Context, Path, Record, Records};

fn time(name: &str, n: u64, mut f: impl FnMut(u64)) {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for i in 0..n {
            f(i);
        }
        best = best.min(t.elapsed().as_nanos() as f64 / n as f64);
    }
    println!("{name:<44} {best:>7.1} ns");
}

fn main() {
    let n = 2_000_000;
    let ledger = Ledger::private();
    let dev = ledger.device_index(&[1; 16]).expect("a device");
    time("ledger charge + release (within the request)", n, |_| {
        black_box(ledger.try_charge(dev, 4096, 1 << 30)).ok();
        ledger.release(dev, 4096);
    });
    let group = Ledger::join(&format!("bench-{}", std::process::id())).expect("group ledger");
    let gdev = group.device_index(&[1; 16]).expect("a device");
    time("group ledger charge + release", n, |_| {
        black_box(group.try_charge(gdev, 4096, 1 << 30)).ok();
        group.release(gdev, 4096);
    });
    let _ = std::fs::remove_file(gpufrac_core::ledger::group_path(&format!("bench-{}", std::process::id())));
    let records = Records::new(1 << 14);
    // Some live allocations around, as in a real program.
    for k in 0..1000u64 {
        records.insert(0x7f00_0000_0000 + k * 0x20_0000, rec());
    }
    time("record insert + remove", n, |i| {
        let key = 0x7e00_0000_0000 + (i % 64) * 0x1000;
        records.insert(key, rec());
        black_box(records.remove(key));
    });
    time("gate pass (launch, copy, set)", n * 10, |_| {
        gpufrac_core::gate::pass_for_bench();
    });
}

fn rec() -> Record {
    Record { bytes: 4096, device: 0, context: Context::Unresolved, path: Path::Linear, above_request: false }
}
