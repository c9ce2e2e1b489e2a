//! Frames on the socket: a little-endian `u32` length, then the body; checked before it
//! is read whole, so an oversized or empty frame closes the connection at once.

use gpufrac_common::protocol::{Reply, MAX_FRAME};
use tokio::io::AsyncReadExt;
use tokio::net::unix::OwnedReadHalf;

/// The next frame body from `reader`, buffering in `buf`; `Ok(None)` at a clean end of
/// stream. Cancel-safe: bytes already read stay in `buf`.
pub(super) async fn next_frame(
    reader: &mut OwnedReadHalf,
    buf: &mut Vec<u8>,
) -> Result<Option<Vec<u8>>, String> {
    loop {
        if buf.len() >= 4 {
            let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if len == 0 || len > MAX_FRAME {
                return Err(format!("frame of {len} bytes (allowed: 1 to {MAX_FRAME})"));
            }
            if buf.len() >= 4 + len {
                let body = buf[4..4 + len].to_vec();
                buf.drain(..4 + len);
                return Ok(Some(body));
            }
        }
        match reader.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => return Err(format!("connection closed in the middle of a frame ({} bytes)", buf.len())),
            Ok(_) => {}
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// Appends `r`, framed, to `out`.
pub(super) fn reply(out: &mut Vec<u8>, r: &Reply) {
    out.extend_from_slice(&r.encode());
}
