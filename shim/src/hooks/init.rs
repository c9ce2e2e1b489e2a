//! `cuInit`: the real driver first, then the shim's configuration and the devices' slices.
//! A bad setting fails `cuInit` with `CUDA_ERROR_NOT_INITIALIZED` and one line on stderr.

use std::ffi::c_uint;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::driver::ffi::{Status, NOT_INITIALIZED, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::{mode, Mode};

fn report_once(message: &str) {
    static REPORTED: AtomicBool = AtomicBool::new(false);
    if !REPORTED.swap(true, Ordering::AcqRel) {
        eprintln!("{message}");
    }
}

pub(crate) fn cu_init(flags: c_uint) -> Status {
    let status = call_real!(cuInit(flags));
    if status != SUCCESS {
        return status;
    }
    match mode() {
        Mode::PassThrough => SUCCESS,
        Mode::Broken(message) => {
            report_once(message);
            NOT_INITIALIZED
        }
        Mode::Enforcing(e) => match e.init_devices() {
            Ok(_) => SUCCESS,
            Err(message) => {
                report_once(message);
                NOT_INITIALIZED
            }
        },
    }
}
