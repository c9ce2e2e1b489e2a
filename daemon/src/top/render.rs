//! Draws a [`View`] with ratatui: a heading, per GPU its memory bar and legend, the
//! processes, the bursts waiting and the last events. Colours only add to what the fill
//! characters already say, so the screen reads without them.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table};
use ratatui::Frame;

use super::{GpuView, Segment, View};

/// Most rows of the queue and of the events drawn (the processes take the rest).
const MOST_LISTED: usize = 8;

fn colour(segment: Segment) -> Color {
    match segment {
        Segment::Guaranteed => Color::Green,
        Segment::Lent => Color::Yellow,
        Segment::Swapped => Color::Magenta,
        Segment::Outside => Color::Red,
        Segment::Free => Color::DarkGray,
    }
}

/// Draws `view` on the whole of `frame`.
pub fn draw(frame: &mut Frame<'_>, view: &View) {
    let area = frame.area();
    let heading = vec![
        Line::from(vec![
            Span::styled(view.title.clone(), Style::default().add_modifier(Modifier::BOLD)),
            Span::raw("   "),
            Span::styled(view.help.clone(), Style::default().fg(Color::Cyan)),
        ]),
        Line::styled(
            view.state.clone(),
            if view.reachable { Style::default() } else { Style::default().fg(Color::Red) },
        ),
    ];
    if !view.reachable {
        frame.render_widget(Paragraph::new(heading), area);
        return;
    }
    let listed = |rows: usize| (rows.clamp(1, MOST_LISTED) + 2) as u16;
    let [top, gpus, processes, queue, events] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(3 * view.gpus.len() as u16 + 1),
        Constraint::Min(4),
        Constraint::Length(listed(view.queue.rows.len())),
        Constraint::Length(listed(view.events.rows.len())),
    ])
    .areas(area);
    frame.render_widget(Paragraph::new(heading), top);
    draw_gpus(frame, gpus, &view.gpus);
    draw_table(
        frame,
        processes,
        &view.processes,
        &format!(" processes (sorted by {}) ", view.sort),
        "no processes",
        |row| match row.get(7).map(String::as_str) {
            Some("waiting" | "waking") => Style::default().fg(Color::Yellow),
            Some("swapped" | "parked" | "parking") => Style::default().fg(Color::Magenta),
            _ => Style::default(),
        },
    );
    draw_table(frame, queue, &view.queue, " bursts waiting (longest first) ", "none", |_| {
        Style::default().fg(Color::Yellow)
    });
    draw_table(frame, events, &view.events, " recent events (newest first) ", "none", |row| {
        match row.get(1).map(String::as_str) {
            Some("waited") => Style::default().fg(Color::Yellow),
            Some("swapped out" | "swapped in" | "parked" | "woken") => Style::default().fg(Color::Magenta),
            Some("ended" | "denied" | "refused" | "uncounted") => Style::default().fg(Color::Red),
            _ => Style::default(),
        }
    });
}

/// Per GPU three lines: its heading, its bar, its legend.
fn draw_gpus(frame: &mut Frame<'_>, area: Rect, gpus: &[GpuView]) {
    let width = usize::from(area.width.saturating_sub(4)).max(1);
    let mut lines = vec![Line::raw("")];
    for gpu in gpus {
        lines.push(Line::styled(gpu.heading(), Style::default().add_modifier(Modifier::BOLD)));
        let mut bar = vec![Span::raw("  ")];
        bar.extend(gpu.bar(width).into_iter().filter(|(_, n)| *n > 0).map(|(segment, n)| {
            Span::styled(segment.fill().to_string().repeat(n), Style::default().fg(colour(segment)))
        }));
        lines.push(Line::from(bar));
        let mut legend = vec![Span::raw("  ")];
        for (segment, text) in gpu.legend() {
            legend.push(Span::styled(segment.fill().to_string(), Style::default().fg(colour(segment))));
            legend.push(Span::raw(format!(" {text}  ")));
        }
        lines.push(Line::from(legend));
    }
    frame.render_widget(Paragraph::new(lines), area);
}

/// A bordered table titled `title`, or `empty` in it when it has no rows.
fn draw_table(
    frame: &mut Frame<'_>,
    area: Rect,
    table: &super::Table,
    title: &str,
    empty: &str,
    style: impl Fn(&[String]) -> Style,
) {
    let block = Block::default().borders(Borders::TOP).title(title.to_owned());
    if table.rows.is_empty() {
        frame.render_widget(Paragraph::new(format!("  {empty}")).block(block), area);
        return;
    }
    let constraints: Vec<Constraint> = table
        .widths()
        .into_iter()
        .map(|w| Constraint::Length(u16::try_from(w).unwrap_or(u16::MAX)))
        .collect();
    let cell = |i: usize, text: &str| {
        let line = Line::raw(text.to_owned());
        Cell::from(if table.right.get(i).copied().unwrap_or(false) { line.right_aligned() } else { line })
    };
    let header = Row::new(table.header.iter().enumerate().map(|(i, h)| cell(i, h)))
        .style(Style::default().add_modifier(Modifier::BOLD));
    let rows =
        table.rows.iter().map(|r| Row::new(r.iter().enumerate().map(|(i, c)| cell(i, c))).style(style(r)));
    frame.render_widget(Table::new(rows, constraints).header(header).column_spacing(2).block(block), area);
}

#[cfg(test)]
mod tests {
    use super::super::App;
    use super::*;
    use crate::status::{Document, GpuStatus, ProcessStatus, Status};
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    fn screen(view: &View, width: u16, height: u16) -> String {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("a test terminal");
        terminal.draw(|f| draw(f, view)).expect("drawn");
        let buffer = terminal.backend().buffer();
        (0..height)
            .map(|y| (0..width).map(|x| buffer[(x, y)].symbol().to_owned()).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_screen_shows_bars_legends_and_rows() {
        let gib = 1u64 << 30;
        let gpu = |uuid: &str, pid| GpuStatus {
            uuid: uuid.into(),
            total: 8 * gib,
            guaranteed: 2 * gib,
            burst: 4 * gib,
            free: 2 * gib,
            processes: vec![ProcessStatus {
                pid,
                group: "web".into(),
                state: "waiting".into(),
                resolver: "wait".into(),
                ..ProcessStatus::default()
            }],
            ..GpuStatus::default()
        };
        let document = Document {
            status: Status { gpus: vec![gpu("GPU-a", 111), gpu("GPU-b", 222)], swap_limit: 0 },
            ..Document::default()
        };
        let mut app = App::new(std::path::Path::new("/tmp/a.sock"));
        app.update(Ok(document), 0);
        let text = screen(&app.view(0), 120, 30);
        for needle in [
            "[1] GPU-a",
            "[2] GPU-b",
            "██████",
            "▓▓▓▓▓▓",
            "······",
            "guaranteed 2.00GiB",
            "lent 4.00GiB",
            "free 2.00GiB",
        ] {
            assert!(text.contains(needle), "{needle}:\n{text}");
        }
        for pid in ["111", "222"] {
            assert!(
                text.lines().any(|l| l.split_whitespace().any(|w| w == pid) && l.contains("waiting")),
                "{pid}:\n{text}"
            );
        }
        // The old arbiter's queue: the waiters from their state.
        assert!(text.contains("bursts waiting"), "{text}");
    }

    #[test]
    fn a_small_or_unreachable_screen_does_not_panic() {
        let mut app = App::new(std::path::Path::new("/nonexistent/a.sock"));
        let error =
            crate::status::fetch_document(std::path::Path::new("/nonexistent/a.sock")).expect_err("nobody");
        app.update(Err(error), 0);
        assert!(screen(&app.view(0), 80, 5).contains("arbiter unreachable"));
        app.update(Ok(Document::default()), 0);
        for (w, h) in [(1, 1), (10, 3), (200, 60)] {
            screen(&app.view(0), w, h);
        }
    }
}
