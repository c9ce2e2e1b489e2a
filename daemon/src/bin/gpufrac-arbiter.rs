//! `gpufrac-arbiter`: the per-node daemon that grants burst memory and resolves
//! collisions. Foundation stage: the binary exists so that the build produces every file
//! of INTERFACE.md; it refuses to start until the arbiter is built, rather than pretend.

use clap::Parser;

#[derive(Parser)]
#[command(name = "gpufrac-arbiter", version, about = "gpufrac's per-node arbiter")]
struct Args {
    /// The unix socket shims connect to.
    #[arg(long, default_value = "/run/gpufrac/arbiter.sock")]
    socket: std::path::PathBuf,
}

fn main() {
    let args = Args::parse();
    eprintln!(
        "gpufrac-arbiter: error: the arbiter is not built yet (socket {} was not opened); shims run standalone",
        args.socket.display()
    );
    std::process::exit(2);
}
