//! The top layer: the exported hooks built from the hook list, the `dlsym` and
//! `cuGetProcAddress` answers, and the handshake with `libgpufrac.so`. The one place where
//! the layers below are named together.

pub(crate) mod exports;
pub(crate) mod init;
pub(crate) mod procaddr;
