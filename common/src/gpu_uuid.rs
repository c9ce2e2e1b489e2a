//! GPU UUIDs: the 16 bytes CUDA reports (`cuDeviceGetUuid`) and the text NVML and
//! Kubernetes use (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).

/// Formats UUID bytes as NVML does.
pub fn format(bytes: &[u8; 16]) -> String {
    let mut text = String::with_capacity(40);
    text.push_str("GPU-");
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            text.push('-');
        }
        text.push_str(&format!("{b:02x}"));
    }
    text
}

/// Parses NVML's text (with or without the `GPU-` prefix) back into bytes.
pub fn parse(text: &str) -> Option<[u8; 16]> {
    let hex: String = text.strip_prefix("GPU-").unwrap_or(text).chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let b = [0x51, 0x6d, 0x67, 0x70, 0x75, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3];
        let s = super::format(&b);
        assert_eq!(s, "GPU-516d6770-7500-0000-0000-000000000003");
        assert_eq!(super::parse(&s), Some(b));
        assert_eq!(super::parse("GPU-zz"), None);
        assert_eq!(super::parse("GPU-516d6770-7500-0000-0000-00000000000g"), None);
    }
}
