//! One frame of `gpufrac top` as plain text, for a stdout that is not a terminal
//! (`gpufrac top | cat`) or `--once`: the same content as the live view, no escape codes,
//! the bars drawn with their fill characters.

use std::fmt::Write;

use super::{Table, View};

/// Width of a GPU's bar in the text frame, in characters.
pub const BAR_WIDTH: usize = 64;

/// `view` as text, ending with a newline.
pub fn frame(view: &View) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}   sorted by {}", view.title, view.sort);
    let _ = writeln!(out, "{}", view.state);
    if !view.reachable {
        return out;
    }
    for gpu in &view.gpus {
        let _ = writeln!(out);
        let _ = writeln!(out, "{}", gpu.heading());
        let _ = writeln!(out, "  [{}]", gpu.bar_text(BAR_WIDTH));
        let legend: Vec<String> =
            gpu.legend().into_iter().map(|(s, text)| format!("{} {text}", s.fill())).collect();
        let _ = writeln!(out, "  {}", legend.join("  "));
    }
    let _ = writeln!(out);
    section(&mut out, "processes", &view.processes, "no processes");
    let _ = writeln!(out);
    section(&mut out, "bursts waiting (longest first)", &view.queue, "none");
    let _ = writeln!(out);
    section(&mut out, "recent events (newest first)", &view.events, "none");
    out
}

/// A titled table, its columns aligned, or `empty` when it has no rows.
fn section(out: &mut String, title: &str, table: &Table, empty: &str) {
    let _ = writeln!(out, "{title}:");
    if table.rows.is_empty() {
        let _ = writeln!(out, "  {empty}");
        return;
    }
    let widths = table.widths();
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::from(" ");
        for (i, cell) in cells.enumerate() {
            let width = widths.get(i).copied().unwrap_or(0);
            let right = table.right.get(i).copied().unwrap_or(false);
            let last = i + 1 == widths.len();
            text.push(' ');
            if right {
                let _ = write!(text, "{cell:>width$}");
            } else if last {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<width$}");
            }
        }
        text.trim_end().to_owned()
    };
    let _ = writeln!(out, "{}", line(&mut table.header.iter().copied()));
    for row in &table.rows {
        let _ = writeln!(out, "{}", line(&mut row.iter().map(String::as_str)));
    }
}

#[cfg(test)]
mod tests {
    use super::super::{App, Key};
    use super::*;
    use crate::status::{Document, GpuStatus, ProcessStatus, Status};

    #[test]
    fn the_frame_has_bars_legends_and_aligned_rows_and_no_escape_codes() {
        let gib = 1u64 << 30;
        let document = Document {
            status: Status {
                gpus: vec![GpuStatus {
                    uuid: "GPU-a".into(),
                    total: 8 * gib,
                    guaranteed: 2 * gib,
                    burst: 2 * gib,
                    free: 4 * gib,
                    processes: vec![ProcessStatus {
                        pid: 4242,
                        group: "web".into(),
                        state: "running".into(),
                        resolver: "wait".into(),
                        held: gib,
                        ..ProcessStatus::default()
                    }],
                    ..GpuStatus::default()
                }],
                swap_limit: 0,
            },
            ..Document::default()
        };
        let mut app = App::new(std::path::Path::new("/tmp/a.sock"));
        app.update(Ok(document), 0);
        app.key(Key::Char('s'));
        let text = frame(&app.view(0));
        assert!(!text.contains('\x1b'), "{text}");
        let bar = format!("  [{}{}{}]", "█".repeat(16), "▓".repeat(16), "·".repeat(32));
        assert!(text.lines().any(|l| l == bar), "{text}");
        assert!(
            text.contains(
                "█ guaranteed 2.00GiB  ▓ lent 2.00GiB  ▒ swapped 0.00GiB  ░ outside 0.00GiB  · free 4.00GiB"
            ),
            "{text}"
        );
        assert!(text.contains("[1] GPU-a  8.00GiB  waiting 0"), "{text}");
        let header = text.lines().find(|l| l.contains("PID")).expect("a header");
        let row = text.lines().find(|l| l.contains("4242")).expect("a row");
        assert_eq!(
            header.find("PID").map(|i| i + 3),
            row.find("4242").map(|i| i + 4),
            "right-aligned:\n{text}"
        );
        assert!(text.contains("bursts waiting (longest first):\n  none"), "{text}");
        assert!(text.lines().next().is_some_and(|l| l.ends_with("sorted by request")), "{text}");
    }

    #[test]
    fn an_unreachable_arbiter_gets_two_lines() {
        let mut app = App::new(std::path::Path::new("/nonexistent/a.sock"));
        let error =
            crate::status::fetch_document(std::path::Path::new("/nonexistent/a.sock")).expect_err("nobody");
        app.update(Err(error), 0);
        let text = frame(&app.view(0));
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(text.lines().nth(1).is_some_and(|l| l.starts_with("arbiter unreachable: ")), "{text}");
    }
}
