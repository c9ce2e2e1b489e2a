//! `gpufrac top`: a live view of the arbiter, refreshed once a second from the document
//! it serves `gpufrac status` (so a user sees only what `status` shows them).
//!
//! This module is the pure part: the state ([`App`]: the last document or why there is
//! none, the sort column, the GPU shown), what each key does, and the [`View`] a frame
//! is drawn from. [`render`] draws a view with ratatui, [`plain`] writes it as text (stdout
//! not a terminal, or `--once`), and `term` drives the terminal.

pub mod plain;
pub mod render;
mod term;

use std::path::Path;

use crate::status::{ago, gib, printable, seconds, share, Document, FetchError, GpuStatus};

pub use term::{run, TopError};

/// A key, as the view understands it (the terminal's events are mapped to these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// A printable character.
    Char(char),
    /// Escape.
    Esc,
    /// Ctrl-C.
    CtrlC,
    /// Anything else.
    Other,
}

/// What the loop does after a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Draw again and go on.
    Continue,
    /// Leave (the terminal is restored).
    Quit,
}

/// The column processes are sorted by (`s` cycles).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SortBy {
    /// Bytes held, most first.
    #[default]
    Held,
    /// The request, largest first.
    Request,
    /// PID, lowest first.
    Pid,
    /// Time waited for bursts, longest first.
    Waits,
}

impl SortBy {
    /// The next column.
    pub fn next(self) -> SortBy {
        match self {
            SortBy::Held => SortBy::Request,
            SortBy::Request => SortBy::Pid,
            SortBy::Pid => SortBy::Waits,
            SortBy::Waits => SortBy::Held,
        }
    }

    /// Its name on screen.
    pub fn label(self) -> &'static str {
        match self {
            SortBy::Held => "held",
            SortBy::Request => "request",
            SortBy::Pid => "pid",
            SortBy::Waits => "waits",
        }
    }
}

/// A part of a GPU's memory bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    /// The groups' requests.
    Guaranteed,
    /// Burst grants.
    Lent,
    /// Burst memory of its processes parked in host RAM, which will want to come back
    /// (drawn out of the free part; its figure is the whole amount).
    Swapped,
    /// Used by processes outside gpufrac: never lent.
    Outside,
    /// Left to lend.
    Free,
}

impl Segment {
    /// Every segment, in the bar's order.
    pub const ALL: [Segment; 5] =
        [Segment::Guaranteed, Segment::Lent, Segment::Swapped, Segment::Outside, Segment::Free];

    /// The character its part of the bar is drawn with: each its own, so that the bar
    /// reads without colour.
    pub fn fill(self) -> char {
        match self {
            Segment::Guaranteed => '█',
            Segment::Lent => '▓',
            Segment::Swapped => '▒',
            Segment::Outside => '░',
            Segment::Free => '·',
        }
    }

    /// Its name in the legend (short: five of them and their figures fit 100 columns).
    pub fn label(self) -> &'static str {
        match self {
            Segment::Guaranteed => "guaranteed",
            Segment::Lent => "lent",
            Segment::Swapped => "swapped",
            Segment::Outside => "outside",
            Segment::Free => "free",
        }
    }
}

/// One GPU's memory, as its bar and legend show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    /// Its number for the keys, from 1, in the status's order.
    pub number: usize,
    /// `GPU-...` (escaped).
    pub uuid: String,
    /// Physical memory.
    pub total: u64,
    /// Bytes per segment, in [`Segment::ALL`]'s order.
    pub bytes: [u64; 5],
    /// Bursts waiting on it.
    pub waiting: usize,
    /// Lent memory being taken back for the guarantees.
    pub reclaiming: u64,
    /// Held by groups beyond what their shims counted (the device's own count).
    pub uncounted: u64,
}

impl GpuView {
    fn of(number: usize, g: &GpuStatus) -> GpuView {
        GpuView {
            number,
            uuid: printable(&g.uuid).into_owned(),
            total: g.total,
            // Parked groups' memory is in host RAM too: drawn with swapped-out memory.
            bytes: [g.guaranteed, g.burst, g.swapped.saturating_add(g.parked), g.outside, g.free],
            waiting: g.waiting,
            reclaiming: g.reclaiming,
            uncounted: g.uncounted,
        }
    }

    /// The bar in `width` cells: how many cells each segment gets, in order, adding up to
    /// `width`. Scaled to the GPU's total; swapped-out memory is drawn out of the free
    /// part (it is not on the GPU), and whatever the figures leave over is free.
    pub fn bar(&self, width: usize) -> Vec<(Segment, usize)> {
        let total = self.total.max(1) as u128;
        let [guaranteed, lent, swapped, outside, _] = self.bytes.map(u128::from);
        let on_gpu = guaranteed + lent + outside;
        let swapped = swapped.min(total.saturating_sub(on_gpu));
        let amounts = [guaranteed, lent, swapped, outside];
        let mut cells = Vec::with_capacity(5);
        let (mut sum, mut drawn) = (0u128, 0usize);
        for (segment, amount) in Segment::ALL.into_iter().zip(amounts) {
            sum += amount;
            // Cumulative rounding: the parts never drift from the whole.
            let end = ((sum.min(total) * width as u128 + total / 2) / total) as usize;
            let end = end.min(width);
            cells.push((segment, end.saturating_sub(drawn)));
            drawn = drawn.max(end);
        }
        cells.push((Segment::Free, width - drawn));
        cells
    }

    /// The bar as text, `width` characters.
    pub fn bar_text(&self, width: usize) -> String {
        self.bar(width).into_iter().flat_map(|(s, n)| std::iter::repeat_n(s.fill(), n)).collect()
    }

    /// The legend: each segment's character, name and figure.
    pub fn legend(&self) -> Vec<(Segment, String)> {
        Segment::ALL
            .into_iter()
            .zip(self.bytes)
            .map(|(s, b)| (s, format!("{} {}", s.label(), gib(b))))
            .collect()
    }

    /// The line above the bar: number, UUID, size, waiters, a debt being taken back.
    pub fn heading(&self) -> String {
        let mut line =
            format!("[{}] {}  {}  waiting {}", self.number, self.uuid, gib(self.total), self.waiting);
        if self.reclaiming > 0 {
            line.push_str(&format!("  taking back {} for guarantees", gib(self.reclaiming)));
        }
        if self.uncounted > 0 {
            line.push_str(&format!("  uncounted {} (charged to its groups)", gib(self.uncounted)));
        }
        line
    }
}

/// A GPU's column: its number, or `-`.
fn gpu_column(index: Option<usize>) -> String {
    index.map_or("-".to_owned(), |i| (i + 1).to_string())
}

/// A process's compute share as `held/request` and its lease state; `-` without one.
fn compute(p: &crate::status::ProcessStatus) -> String {
    if p.compute_limit_pm == 0 {
        return "-".to_owned();
    }
    let state: String = p.compute_state.chars().filter(|c| c.is_ascii_alphabetic()).take(10).collect();
    format!("{}/{} {state}", share(p.compute_held_pm), share(p.compute_request_pm))
}

/// Rows of text under a header, for the processes, the queue and the events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    /// Column names.
    pub header: Vec<&'static str>,
    /// Whether each column is right-aligned (numbers).
    pub right: Vec<bool>,
    /// The cells, escaped.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// Each column's width: its widest cell or name.
    pub fn widths(&self) -> Vec<usize> {
        self.header
            .iter()
            .enumerate()
            .map(|(i, h)| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(i))
                    .map(|c| c.chars().count())
                    .chain([h.len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    }
}

/// Everything one frame shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    /// `gpufrac top` and the socket.
    pub title: String,
    /// The keys, with the sort column and the GPUs shown.
    pub help: String,
    /// The column processes are sorted by.
    pub sort: &'static str,
    /// When the document was fetched, or why there is none: `arbiter unreachable: ...`.
    pub state: String,
    /// Whether the arbiter answered the last time it was asked.
    pub reachable: bool,
    /// The GPUs shown.
    pub gpus: Vec<GpuView>,
    /// A process per row on the GPUs shown, sorted.
    pub processes: Table,
    /// The bursts waiting on the GPUs shown, longest first.
    pub queue: Table,
    /// The last events on the GPUs shown, newest first.
    pub events: Table,
}

/// What the view shows and how: the last document, the sort, the GPU chosen.
#[derive(Debug, Clone)]
pub struct App {
    socket: String,
    document: Option<Document>,
    /// Why the last fetch failed, if it did.
    error: Option<String>,
    /// When the document (or the error) came, ms since the epoch.
    fetched_ms: u64,
    sort: SortBy,
    /// The GPU shown alone (an index into the document's GPUs), or all.
    gpu: Option<usize>,
}

impl App {
    /// Nothing fetched yet from the arbiter at `socket`.
    pub fn new(socket: &Path) -> App {
        App {
            socket: printable(&socket.display().to_string()).into_owned(),
            document: None,
            error: None,
            fetched_ms: 0,
            sort: SortBy::default(),
            gpu: None,
        }
    }

    /// A fetch's answer, at `now_ms`: the new document, or why there is none (what was
    /// shown before is dropped, not shown as if current).
    pub fn update(&mut self, fetched: Result<Document, FetchError>, now_ms: u64) {
        match fetched {
            Ok(document) => {
                self.fetched_ms = now_ms;
                self.document = Some(document);
                self.error = None;
            }
            Err(e) => self.unreachable(&e, now_ms),
        }
    }

    /// The arbiter did not answer at `now_ms`: why is shown, and nothing it said before.
    pub fn unreachable(&mut self, error: &FetchError, now_ms: u64) {
        self.fetched_ms = now_ms;
        self.document = None;
        self.error = Some(error.to_string());
    }

    /// The column sorted by.
    pub fn sort(&self) -> SortBy {
        self.sort
    }

    /// The GPU shown alone (index into the status's GPUs), or `None` for all.
    pub fn gpu(&self) -> Option<usize> {
        self.gpu
    }

    /// Applies a key: `s` next sort column, `1`-`9` that GPU alone (if there is one),
    /// `0` or `a` every GPU, `q`, Esc or Ctrl-C quit.
    pub fn key(&mut self, key: Key) -> Action {
        match key {
            Key::Char('q' | 'Q') | Key::Esc | Key::CtrlC => return Action::Quit,
            Key::Char('s' | 'S') => self.sort = self.sort.next(),
            Key::Char('0' | 'a' | 'A') => self.gpu = None,
            Key::Char(c @ '1'..='9') => {
                let index = c as usize - '1' as usize;
                let known = self.document.as_ref().map(|d| d.status.gpus.len());
                if known.is_none_or(|count| index < count) {
                    self.gpu = Some(index);
                }
            }
            Key::Char(_) | Key::Other => {}
        }
        Action::Continue
    }

    /// The frame to draw at `now_ms`: the arbiter's GPUs, processes, waiting bursts and
    /// last events, of the GPU chosen (or all).
    pub fn view(&self, now_ms: u64) -> View {
        let mut view = self.frame();
        let Some(document) = &self.document else {
            view.state = match &self.error {
                Some(e) => format!("arbiter unreachable: {e} (retrying every second)"),
                None => "asking the arbiter...".to_owned(),
            };
            return view;
        };
        view.state = format!("updated {}", ago(self.fetched_ms, now_ms));
        let gpus = &document.status.gpus;
        view.gpus = gpus
            .iter()
            .enumerate()
            .filter(|(i, _)| self.wanted(Some(*i)))
            .map(|(i, g)| GpuView::of(i + 1, g))
            .collect();
        view.processes.rows = self.process_rows(document);
        let truncated: usize =
            gpus.iter().enumerate().filter(|(i, _)| self.wanted(Some(*i))).map(|(_, g)| g.truncated).sum();
        if truncated > 0 {
            view.state.push_str(&format!("   ({truncated} more processes not listed)"));
        }
        view.queue.rows = self.queue_rows(document);
        view.events.rows = self.event_rows(document, now_ms);
        view
    }

    /// Whether the GPU at `index` is shown (all are, unless one is chosen).
    fn wanted(&self, index: Option<usize>) -> bool {
        self.gpu.is_none() || index == self.gpu
    }

    /// The frame without the arbiter's document: titles, help and the tables' headers.
    fn frame(&self) -> View {
        let shown = match self.gpu {
            Some(i) => format!("GPU {} only", i + 1),
            None => "all GPUs".to_owned(),
        };
        let help = format!("q quit   s sort: {}   1-9 one GPU, 0/a all: {shown}", self.sort.label());
        let title = format!("gpufrac top   {}", self.socket);
        View {
            title,
            help,
            sort: self.sort.label(),
            state: String::new(),
            reachable: self.document.is_some(),
            gpus: Vec::new(),
            processes: Table {
                header: vec![
                    "GPU",
                    "PID",
                    "GROUP",
                    "POD",
                    "REQUEST",
                    "LIMIT",
                    "HELD",
                    "STATE",
                    "PRIO",
                    "RESOLVER",
                    "WAITS",
                    "SWAPS",
                    "GPU TIME",
                    "UNCOUNTED",
                ],
                right: vec![
                    true, true, false, false, true, true, true, false, true, false, true, true, false, true,
                ],
                rows: Vec::new(),
            },
            queue: Table {
                header: vec!["GPU", "PID", "GROUP", "NEEDS", "WAITING"],
                right: vec![true, true, false, true, true],
                rows: Vec::new(),
            },
            events: Table {
                header: vec!["WHEN", "EVENT", "GPU", "PID", "GROUP", "BYTES", "DETAIL"],
                right: vec![true, false, true, true, false, true, false],
                rows: Vec::new(),
            },
        }
    }

    /// The processes' rows, sorted as chosen.
    fn process_rows(&self, document: &Document) -> Vec<Vec<String>> {
        let gpus = &document.status.gpus;
        let wanted = |index: Option<usize>| self.wanted(index);
        let mut processes: Vec<(usize, &crate::status::ProcessStatus)> = gpus
            .iter()
            .enumerate()
            .filter(|(i, _)| wanted(Some(*i)))
            .flat_map(|(i, g)| g.processes.iter().map(move |p| (i, p)))
            .collect();
        processes.sort_by(|(ga, a), (gb, b)| {
            let by = match self.sort {
                SortBy::Held => b.held.cmp(&a.held),
                SortBy::Request => b.request.cmp(&a.request),
                SortBy::Pid => std::cmp::Ordering::Equal,
                SortBy::Waits => b.waited_ms.cmp(&a.waited_ms),
            };
            by.then(a.pid.cmp(&b.pid)).then(ga.cmp(gb))
        });
        processes
            .into_iter()
            .map(|(i, p)| {
                vec![
                    (i + 1).to_string(),
                    p.pid.to_string(),
                    printable(&p.group).into_owned(),
                    if p.pod.is_empty() { "-".to_owned() } else { printable(&p.pod).into_owned() },
                    gib(p.request),
                    gib(p.limit),
                    gib(p.held),
                    printable(&p.state).into_owned(),
                    p.priority.to_string(),
                    printable(&p.resolver).into_owned(),
                    seconds(p.waited_ms),
                    seconds(p.swapped_ms),
                    compute(p),
                    if p.uncounted > 0 { gib(p.uncounted) } else { "-".to_owned() },
                ]
            })
            .collect()
    }

    /// The waiting bursts' rows, longest waiting first.
    fn queue_rows(&self, document: &Document) -> Vec<Vec<String>> {
        let gpus = &document.status.gpus;
        let number = |uuid: &str| gpus.iter().position(|g| g.uuid == uuid);
        let wanted = |index: Option<usize>| self.wanted(index);
        let mut rows = Vec::new();
        if document.queue.is_empty() {
            // An arbiter from before the queue was served: its waiters, from their state.
            for (i, g) in gpus.iter().enumerate().filter(|(i, _)| wanted(Some(*i))) {
                for p in g.processes.iter().filter(|p| p.state == "waiting") {
                    rows.push(vec![
                        (i + 1).to_string(),
                        p.pid.to_string(),
                        printable(&p.group).into_owned(),
                        "?".to_owned(),
                        "-".to_owned(),
                    ]);
                }
            }
        }
        for q in &document.queue {
            let index = number(&q.gpu);
            if !wanted(index) {
                continue;
            }
            let needs = if q.resume { format!("{} (swap-in)", gib(q.bytes)) } else { gib(q.bytes) };
            rows.push(vec![
                gpu_column(index),
                q.pid.to_string(),
                printable(&q.group).into_owned(),
                needs,
                seconds(q.waited_ms),
            ]);
        }
        rows
    }

    /// The last events' rows, newest first.
    fn event_rows(&self, document: &Document, now_ms: u64) -> Vec<Vec<String>> {
        let number = |uuid: &str| document.status.gpus.iter().position(|g| g.uuid == uuid);
        let mut rows = Vec::new();
        for e in document.events.iter().rev() {
            let index = if e.gpu.is_empty() { None } else { number(&e.gpu) };
            // An event about no one GPU shows whichever is chosen.
            if !e.gpu.is_empty() && !self.wanted(index) {
                continue;
            }
            rows.push(vec![
                ago(e.at_ms, now_ms),
                e.kind.label().to_owned(),
                gpu_column(index),
                e.pid.to_string(),
                if e.group.is_empty() { "-".to_owned() } else { printable(&e.group).into_owned() },
                if e.bytes == 0 { "-".to_owned() } else { gib(e.bytes) },
                printable(&e.detail).into_owned(),
            ]);
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{Event, EventKind, ProcessStatus, QueuedBurst, Status};

    const GIB: u64 = 1 << 30;

    fn process(pid: u32, held: u64, request: u64, waited_ms: u64) -> ProcessStatus {
        ProcessStatus {
            pid,
            group: format!("g{pid}"),
            request,
            limit: 4 * GIB,
            held,
            resolver: "wait".into(),
            state: "running".into(),
            waited_ms,
            ..ProcessStatus::default()
        }
    }

    fn document() -> Document {
        let gpu = |uuid: &str, processes| GpuStatus {
            uuid: uuid.into(),
            total: 8 * GIB,
            guaranteed: 2 * GIB,
            burst: 4 * GIB,
            free: 2 * GIB,
            waiting: 1,
            processes,
            ..GpuStatus::default()
        };
        Document {
            status: Status {
                gpus: vec![
                    gpu("GPU-a", vec![process(10, 3 * GIB, GIB, 0), process(20, GIB, 2 * GIB, 1500)]),
                    gpu("GPU-b", vec![process(30, 2 * GIB, 0, 200)]),
                ],
                swap_limit: 0,
            },
            queue: vec![QueuedBurst {
                gpu: "GPU-a".into(),
                pid: 20,
                group: "g20".into(),
                bytes: GIB,
                waited_ms: 1200,
                ..QueuedBurst::default()
            }],
            events: vec![
                Event {
                    at_ms: 1_000,
                    gpu: "GPU-a".into(),
                    pid: 20,
                    kind: EventKind::Waited,
                    bytes: GIB,
                    detail: "waited 1200 ms for its memory".into(),
                    ..Event::default()
                },
                Event {
                    at_ms: 2_000,
                    gpu: "GPU-b".into(),
                    pid: 30,
                    kind: EventKind::SwappedOut,
                    bytes: GIB,
                    ..Event::default()
                },
            ],
        }
    }

    fn app() -> App {
        let mut app = App::new(Path::new("/run/gpufrac/arbiter.sock"));
        app.update(Ok(document()), 5_000);
        app
    }

    fn pids(view: &View) -> Vec<&str> {
        view.processes.rows.iter().map(|r| r[1].as_str()).collect()
    }

    #[test]
    fn s_cycles_the_sort_column() {
        let mut app = app();
        assert_eq!(pids(&app.view(5_000)), ["10", "30", "20"], "held, most first");
        let mut seen = Vec::new();
        for _ in 0..4 {
            assert_eq!(app.key(Key::Char('s')), Action::Continue);
            seen.push((app.sort(), pids(&app.view(5_000)).join(" ")));
        }
        assert_eq!(
            seen,
            [
                (SortBy::Request, "20 10 30".to_owned()),
                (SortBy::Pid, "10 20 30".to_owned()),
                (SortBy::Waits, "20 30 10".to_owned()),
                (SortBy::Held, "10 30 20".to_owned()),
            ]
        );
        assert!(app.view(5_000).help.contains("sort: held"));
    }

    #[test]
    fn a_digit_shows_that_gpu_alone_and_0_or_a_all() {
        let mut app = app();
        app.key(Key::Char('2'));
        assert_eq!(app.gpu(), Some(1));
        let view = app.view(5_000);
        assert_eq!(view.gpus.iter().map(|g| g.number).collect::<Vec<_>>(), [2]);
        assert_eq!(pids(&view), ["30"]);
        assert!(view.queue.rows.is_empty(), "the waiter is on GPU 1");
        assert_eq!(view.events.rows.len(), 1, "only GPU 2's event");
        assert!(view.help.contains("GPU 2 only"), "{}", view.help);
        app.key(Key::Char('3'));
        assert_eq!(app.gpu(), Some(1), "there is no GPU 3");
        app.key(Key::Char('0'));
        assert_eq!(app.gpu(), None);
        app.key(Key::Char('1'));
        app.key(Key::Char('a'));
        assert_eq!(app.view(5_000).gpus.len(), 2);
    }

    #[test]
    fn q_escape_and_ctrl_c_quit_other_keys_do_not() {
        let mut app = app();
        for key in [Key::Char('x'), Key::Other, Key::Char(' ')] {
            assert_eq!(app.key(key), Action::Continue);
        }
        for key in [Key::Char('q'), Key::Esc, Key::CtrlC] {
            assert_eq!(app.key(key), Action::Quit);
        }
    }

    #[test]
    fn the_queue_and_events_are_listed_newest_event_first() {
        let view = app().view(5_000);
        assert_eq!(view.queue.rows, [["1", "20", "g20", "1.00GiB", "1.2s"]]);
        let events: Vec<(&str, &str, &str)> =
            view.events.rows.iter().map(|r| (r[0].as_str(), r[1].as_str(), r[3].as_str())).collect();
        assert_eq!(events, [("3s ago", "swapped out", "30"), ("4s ago", "waited", "20")]);
        assert_eq!(view.state, "updated 0s ago");
    }

    #[test]
    fn an_older_arbiter_without_a_queue_shows_its_waiters_from_their_state() {
        let mut document = document();
        document.queue.clear();
        document.status.gpus[0].processes[1].state = "waiting".into();
        let mut app = App::new(Path::new("s"));
        app.update(Ok(document), 0);
        assert_eq!(app.view(0).queue.rows, [["1", "20", "g20", "?", "-"]]);
    }

    #[test]
    fn an_unreachable_arbiter_is_said_and_nothing_stale_is_shown() {
        let mut app = app();
        let error =
            crate::status::fetch_document(Path::new("/nonexistent/arbiter.sock")).expect_err("nobody");
        app.update(Err(error), 6_000);
        let view = app.view(6_000);
        assert!(!view.reachable);
        assert!(
            view.state
                .starts_with("arbiter unreachable: cannot reach the arbiter at /nonexistent/arbiter.sock"),
            "{}",
            view.state
        );
        assert!(view.gpus.is_empty() && view.processes.rows.is_empty());
        app.update(Ok(document()), 7_000);
        assert!(app.view(7_000).reachable);
    }

    #[test]
    fn the_bar_splits_the_gpu_by_segment_and_reads_without_colour() {
        let gpu = GpuView {
            number: 1,
            uuid: "GPU-a".into(),
            total: 8 * GIB,
            bytes: [2 * GIB, 3 * GIB, GIB, GIB, GIB],
            waiting: 0,
            reclaiming: 0,
            uncounted: 0,
        };
        assert_eq!(gpu.bar_text(16), "████▓▓▓▓▓▓▒▒░░··");
        assert_eq!(gpu.bar(16).iter().map(|(_, n)| n).sum::<usize>(), 16);
        // Swapped-out memory larger than what is free is drawn only as far as the free part.
        let swapped = GpuView { bytes: [4 * GIB, 4 * GIB, 8 * GIB, 0, 0], ..gpu.clone() };
        assert_eq!(swapped.bar_text(8), "████▓▓▓▓");
        // Figures that do not add up (a document taken mid-change) never overflow the bar.
        let odd = GpuView { bytes: [6 * GIB, 6 * GIB, 0, 6 * GIB, 0], ..gpu.clone() };
        assert_eq!(odd.bar_text(8).chars().count(), 8);
        let empty = GpuView { total: 0, bytes: [0; 5], ..gpu.clone() };
        assert_eq!(empty.bar_text(4), "····");
        let legend: Vec<String> =
            gpu.legend().into_iter().map(|(s, t)| format!("{} {t}", s.fill())).collect();
        assert_eq!(
            legend,
            [
                "█ guaranteed 2.00GiB",
                "▓ lent 3.00GiB",
                "▒ swapped 1.00GiB",
                "░ outside 1.00GiB",
                "· free 1.00GiB"
            ]
        );
    }

    #[test]
    fn memory_held_uncounted_is_shown_per_process_and_per_gpu() {
        let mut document = document();
        let gpu = &mut document.status.gpus[0];
        gpu.uncounted = GIB;
        gpu.processes[1].uncounted = GIB;
        let mut app = app();
        app.update(Ok(document), 1_000);
        let view = app.view(1_000);
        let column = view.processes.header.iter().position(|h| *h == "UNCOUNTED").expect("a column");
        let shown: Vec<(&str, &str)> =
            view.processes.rows.iter().map(|r| (r[1].as_str(), r[column].as_str())).collect();
        assert_eq!(shown, [("10", "-"), ("30", "-"), ("20", "1.00GiB")]);
        assert!(view.gpus[0].heading().contains("uncounted 1.00GiB"), "{}", view.gpus[0].heading());
        assert!(!view.gpus[1].heading().contains("uncounted"));
    }

    #[test]
    fn names_are_escaped() {
        let mut document = document();
        document.status.gpus[0].processes[0].group = "evil\x1b[2J".into();
        document.events[0].detail = "x\ny".into();
        let mut app = App::new(Path::new("s"));
        app.update(Ok(document), 0);
        let view = app.view(0);
        let group = view.processes.rows.iter().find(|r| r[1] == "10").map(|r| r[2].as_str());
        assert_eq!(group, Some("evil\\u{1b}[2J"));
        assert_eq!(view.events.rows[1][6], "x\\ny");
    }
}
