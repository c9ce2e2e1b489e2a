//! A mostly idle inference server, for the parking tests and the density benchmark: it
//! loads a "model" of `--model` bytes in `--chunk`-sized `cuMemAlloc` calls, fills each
//! chunk with its own value on the device, then serves requests read from stdin. A request
//! runs simgpu's checksum kernel over one chunk (a launch: the call that wakes a parked
//! model) and checks the result, so every request proves that the chunk came back intact.
//!
//! ```text
//! parkable_model [--model SIZE] [--chunk SIZE] [--seed N]
//! ```
//!
//! stdin, one command per line: `REQ <id>` (a request, on chunk `id` modulo the chunks),
//! `CHECK` (every chunk), `RELEASE` (its primary context released, as the CUDA runtime
//! does at exit; nothing else may follow but `QUIT`), `QUIT`. stdout, one line each, flushed: `READY <model bytes>`
//! once loaded; `OK <id> us=<microseconds>` per request served (the time from reading it to
//! its answer, a wake included); `FAIL <id> <CUDA error name>` when a call failed (a wake
//! refused after GPUFRAC_WAIT_TIMEOUT: out-of-memory); `CHECKED <chunks>`; `RELEASED
//! <CUDA error name>`. stderr:
//! `FAILED init|model <error>` (exit 3), `CORRUPT ...` (exit 4), a bad argument (exit 2).

use std::io::BufRead;
use std::process::exit;
use std::time::Instant;

use gpufrac_e2e::device_model::{alloc, error_name, init, say, Block, Kernels};
use gpufrac_e2e::rng::Rng;

const USAGE: &str = "usage: parkable_model [--model SIZE] [--chunk SIZE] [--seed N]";

fn bad(message: String) -> ! {
    eprintln!("parkable_model: {message}\n{USAGE}");
    exit(2)
}

/// The value chunk `j` of the model seeded `seed` is filled with.
fn value(seed: u64, j: usize) -> u32 {
    (Rng::new(seed.wrapping_mul(0x9e37_79b9) ^ j as u64).next() >> 32) as u32 | 1
}

/// Checks chunk `j`: its checksum on the device against what its fill makes it.
fn check_chunk(k: &Kernels, model: &[Block], j: usize, seed: u64, scratch: u64) -> Result<(), String> {
    let b = &model[j];
    let count = (b.bytes / 4) as usize;
    let got = k.checksum(b.ptr, count, scratch).map_err(error_name)?;
    let want = (count as u64).wrapping_mul(u64::from(value(seed, j)));
    if got != want {
        eprintln!("CORRUPT chunk {j} at {:#x}: checksum {got:#x}, expected {want:#x}", b.ptr);
        exit(4);
    }
    Ok(())
}

fn main() {
    let (mut model_bytes, mut chunk, mut seed) = (1u64 << 30, 256u64 << 20, u64::from(std::process::id()));
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| bad(format!("{flag} needs a value")));
        let size = || match gpufrac_common::parse_bytes(flag, value) {
            Ok(bytes) if bytes >= 4096 => bytes,
            Ok(_) => bad(format!("{flag} {value:?} is too small: at least 4KiB")),
            Err(e) => bad(e.to_string()),
        };
        match flag.as_str() {
            "--model" => model_bytes = size(),
            "--chunk" => chunk = size(),
            "--seed" => {
                seed = value
                    .parse()
                    .unwrap_or_else(|_| bad(format!("--seed {value:?}: expected a whole number")))
            }
            _ => bad(format!("unknown argument {flag:?}")),
        }
    }
    let k = init().unwrap_or_else(|r| {
        eprintln!("FAILED init {}", error_name(r));
        exit(3)
    });
    let failed = |r| -> ! {
        eprintln!("FAILED model {}", error_name(r));
        exit(3)
    };
    // A block of its own for the checksums' results, so that every chunk is checked whole.
    let scratch = alloc(2 << 20).unwrap_or_else(|r| failed(r)).ptr;
    let mut model = Vec::new();
    let mut left = model_bytes;
    while left > 0 {
        let bytes = left.min(chunk) / 4 * 4;
        model.push(alloc(bytes.max(4)).unwrap_or_else(|r| failed(r)));
        left -= left.min(chunk);
    }
    for (j, b) in model.iter().enumerate() {
        k.fill(b.ptr, value(seed, j), (b.bytes / 4) as usize).unwrap_or_else(|r| failed(r));
    }
    for j in 0..model.len() {
        check_chunk(&k, &model, j, seed, scratch).unwrap_or_else(|e| {
            eprintln!("FAILED model {e}");
            exit(3)
        });
    }
    say(&format!("READY {model_bytes}"));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("REQ"), Some(id)) => {
                let started = Instant::now();
                let j = id.parse::<usize>().unwrap_or(0) % model.len();
                match check_chunk(&k, &model, j, seed, scratch) {
                    Ok(()) => say(&format!("OK {id} us={}", started.elapsed().as_micros())),
                    Err(e) => say(&format!("FAIL {id} {e}")),
                }
            }
            (Some("CHECK"), _) => {
                let failed = (0..model.len()).find_map(|j| check_chunk(&k, &model, j, seed, scratch).err());
                match failed {
                    None => say(&format!("CHECKED {}", model.len())),
                    Some(e) => say(&format!("FAIL check {e}")),
                }
            }
            (Some("RELEASE"), _) => {
                // SAFETY: device 0, whose primary context `init` retained.
                let status = unsafe { cudarc::driver::sys::cuDevicePrimaryCtxRelease_v2(0) };
                say(&format!("RELEASED {}", error_name(status)));
            }
            (Some("QUIT"), _) => break,
            _ => say(&format!("FAIL {line:?} unknown command")),
        }
    }
}
