//! `gpufrac-device-plugin`: the Kubernetes device plugin advertising fractional GPUs, and
//! the admission webhook. Foundation stage: the binary exists so that the build produces
//! every file of INTERFACE.md; it refuses to start until the plugin is built.

use clap::Parser;

#[derive(Parser)]
#[command(name = "gpufrac-device-plugin", version, about = "gpufrac's Kubernetes device plugin")]
struct Args {
    /// Folder of the kubelet's device plugin sockets.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    device_plugin_dir: std::path::PathBuf,
}

fn main() {
    let args = Args::parse();
    eprintln!(
        "gpufrac-device-plugin: error: the device plugin is not built yet (nothing registered in {})",
        args.device_plugin_dir.display()
    );
    std::process::exit(2);
}
