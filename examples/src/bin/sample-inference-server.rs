//! A sample inference server for gpufrac's demo and tests, written like a real one on
//! top of `cudarc` (which loads the CUDA driver with dlopen/dlsym).
//!
//! It loads a "model" (one buffer filled by a kernel), then serves batches: each batch
//! allocates its activations on the stream-ordered allocator, runs kernels over them,
//! reads a checksum back to the host and checks it, and frees the activations. Memory
//! therefore swings with the batch size, as in PyTorch-based servers. On the simulated
//! GPU it uses simgpu's built-in kernels; every result is verified, so a lost or
//! corrupted byte fails the run.
//!
//! Each event is one line on stdout: `<name> <event> key=value ...`.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

#[derive(Parser, Debug)]
#[command(about = "A simulated inference server on cudarc, for gpufrac's demo and tests")]
struct Args {
    /// Name shown on every line.
    #[arg(long, default_value = "server")]
    name: String,
    /// Size of the model's weights (any gpufrac size, e.g. 512MiB).
    #[arg(long, default_value = "256MiB")]
    model: String,
    /// Activation memory of each batch, comma-separated, served in order and repeated.
    #[arg(long, default_value = "64MiB,128MiB")]
    batches: String,
    /// Number of batches to serve.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Time each batch keeps the GPU busy (simgpu_sleep_us), e.g. 20ms.
    #[arg(long, default_value = "0ms")]
    compute: String,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Memory held from after the model is loaded to the end (a KV cache, say), filled
    /// with a known value and verified before exiting.
    #[arg(long)]
    keep: Option<String>,
    /// Time to sit idle (no GPU work) after the batches, before the final checks.
    #[arg(long, default_value = "0ms")]
    idle: String,
}

const KERNELS_PTX: &str = "// simgpu built-in kernels: simgpu_fill_u32, simgpu_checksum_u32, simgpu_sleep_us";

struct Kernels {
    fill: CudaFunction,
    checksum: CudaFunction,
    sleep: CudaFunction,
}

fn bytes(input: &str, value: &str) -> Result<usize> {
    Ok(gpufrac_common::parse_bytes(input, value)? as usize)
}

fn is_oom(e: &DriverError) -> bool {
    e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

/// Fills `buf` with `value` on the GPU and checks the checksum the GPU computes.
fn fill_and_verify(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    buf: &mut CudaSlice<u32>,
    value: u32,
    sum: &mut CudaSlice<u64>,
) -> Result<()> {
    let count = buf.len();
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the simgpu kernels take (u32*, u32, size_t) and (u32*, size_t, u64*),
    // matching the arguments pushed here.
    unsafe {
        stream.launch_builder(&k.fill).arg(&mut *buf).arg(&value).arg(&count).launch(cfg)?;
        stream.launch_builder(&k.checksum).arg(&*buf).arg(&count).arg(&mut *sum).launch(cfg)?;
    }
    let got = stream.clone_dtoh(&*sum)?[0];
    let want = (count as u64).wrapping_mul(value as u64);
    if got != want {
        bail!("checksum mismatch: GPU says {got}, expected {want}");
    }
    Ok(())
}

fn run(args: &Args) -> Result<()> {
    let model_bytes = bytes("--model", &args.model)?;
    let batches = args.batches.split(',').map(|b| bytes("--batches", b)).collect::<Result<Vec<_>>>()?;
    let compute_us = gpufrac_common::parse_duration("--compute", &args.compute)?.as_micros() as u64;
    let keep_bytes = args.keep.as_deref().map(|k| bytes("--keep", k)).transpose()?.unwrap_or(0);
    let idle = gpufrac_common::parse_duration("--idle", &args.idle)?;
    let name = &args.name;

    let ctx = CudaContext::new(args.device).context("creating a CUDA context")?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(KERNELS_PTX)).context("loading kernels")?;
    let k = Kernels {
        fill: module.load_function("simgpu_fill_u32")?,
        checksum: module.load_function("simgpu_checksum_u32")?,
        sleep: module.load_function("simgpu_sleep_us")?,
    };
    let (free, total) = cudarc::driver::result::mem_get_info()?;
    println!("{name} started device={} total={total} free={free}", args.device);

    let started = Instant::now();
    let mut model = stream.alloc_zeros::<u32>(model_bytes / 4).context("loading the model")?;
    // The result buffer lives with the model: a batch then makes one allocation only.
    let mut sum = stream.alloc_zeros::<u64>(1)?;
    fill_and_verify(&stream, &k, &mut model, 0x600d, &mut sum)?;
    println!("{name} model-loaded bytes={model_bytes} ms={}", started.elapsed().as_millis());
    let mut kept = match keep_bytes {
        0 => None,
        n => {
            let mut buf = stream.alloc_zeros::<u32>(n / 4).context("allocating the kept memory")?;
            fill_and_verify(&stream, &k, &mut buf, 0xcafe, &mut sum)?;
            println!("{name} holding bytes={n}");
            Some(buf)
        }
    };

    let mut served = 0;
    let mut oom = 0;
    for step in 0..args.steps {
        let want = batches[step % batches.len()];
        let t = Instant::now();
        // One batch: activations, kernels over them, a checked result. Running out of
        // memory anywhere in it fails this batch only, as a server fails one request.
        let mut batch = || -> Result<()> {
            let mut activations = stream.alloc_zeros::<u32>(want / 4)?;
            fill_and_verify(&stream, &k, &mut activations, step as u32 + 1, &mut sum)?;
            if compute_us > 0 {
                // SAFETY: simgpu_sleep_us takes one u64.
                unsafe {
                    stream.launch_builder(&k.sleep).arg(&compute_us).launch(LaunchConfig {
                        grid_dim: (1, 1, 1),
                        block_dim: (1, 1, 1),
                        shared_mem_bytes: 0,
                    })?;
                }
            }
            stream.synchronize()?;
            drop(activations);
            stream.synchronize()?;
            Ok(())
        };
        match batch() {
            Ok(()) => {
                served += 1;
                println!("{name} batch={step} bytes={want} ms={}", t.elapsed().as_millis());
            }
            Err(e) if e.downcast_ref::<DriverError>().is_some_and(is_oom) => {
                oom += 1;
                println!("{name} out-of-memory batch={step} bytes={want}");
            }
            Err(e) => return Err(e),
        }
    }
    if !idle.is_zero() {
        println!("{name} idle ms={}", idle.as_millis());
        std::thread::sleep(idle);
    }
    // The kept memory and the model must have survived everything untouched.
    if let Some(buf) = kept.as_mut() {
        let count = buf.len();
        // SAFETY: as in fill_and_verify.
        unsafe {
            stream.launch_builder(&k.checksum).arg(&*buf).arg(&count).arg(&mut sum).launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        let got = stream.clone_dtoh(&sum)?[0];
        if got != count as u64 * 0xcafe {
            bail!("kept memory corrupted: checksum {got}");
        }
        println!("{name} kept-memory-intact bytes={keep_bytes}");
    }
    let count = model.len();
    // SAFETY: as in fill_and_verify.
    unsafe {
        stream.launch_builder(&k.checksum).arg(&model).arg(&count).arg(&mut sum).launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        })?;
    }
    let got = stream.clone_dtoh(&sum)?[0];
    if got != count as u64 * 0x600d {
        bail!("model corrupted: checksum {got}");
    }
    println!("{name} done served={served} out-of-memory={oom}");
    Ok(())
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("sample-inference-server {}: error: {e:#}", args.name);
        std::process::exit(1);
    }
}
