//! Drives the terminal for `gpufrac top`: raw mode and the alternate screen while it
//! runs, restored on the way out whatever the way (`q`, an error, a panic); a thread asks
//! the arbiter once a second so that a slow arbiter never freezes the keys. When stdout
//! is not a terminal, or with `--once`, one plain-text frame is printed instead.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use crossterm::terminal::{self, EnterAlternateScreen, LeaveAlternateScreen};
use crossterm::{cursor, execute};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;

use super::{plain, render, Action, App, Key};
use crate::status::{fetch_document, now_ms, Document, FetchError};

/// How often the arbiter is asked.
const REFRESH: Duration = Duration::from_secs(1);
/// How long a key is waited for before the frame is drawn again anyway.
const KEY_WAIT: Duration = Duration::from_millis(200);

/// Why `gpufrac top` stopped other than by a key.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    /// The terminal could not be set up, drawn on or read.
    #[error("cannot drive the terminal: {0}")]
    Terminal(#[from] std::io::Error),
    /// A single frame was asked for (stdout not a terminal, `--once`) and the arbiter did
    /// not answer; the frame printed says so too.
    #[error(transparent)]
    Unreachable(FetchError),
}

/// Runs `gpufrac top` against the arbiter at `socket` until a quitting key, or prints one
/// frame when stdout is not a terminal or `once` is set.
pub fn run(socket: &Path, once: bool) -> Result<(), TopError> {
    if once || !std::io::stdout().is_terminal() {
        return print_once(socket);
    }
    live(socket)
}

/// One plain-text frame on stdout.
fn print_once(socket: &Path) -> Result<(), TopError> {
    let mut app = App::new(socket);
    let fetched = fetch_document(socket);
    let failed = match fetched {
        Ok(document) => {
            app.update(Ok(document), now_ms());
            None
        }
        Err(error) => {
            app.unreachable(&error, now_ms());
            Some(error)
        }
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(plain::frame(&app.view(now_ms())).as_bytes())?;
    stdout.flush()?;
    match failed {
        Some(e) => Err(TopError::Unreachable(e)),
        None => Ok(()),
    }
}

/// Puts the terminal back: cooked mode, the main screen, the cursor shown. Safe to call
/// more than once, and from the panic hook.
fn restore() {
    let _ = terminal::disable_raw_mode();
    let _ = execute!(std::io::stdout(), LeaveAlternateScreen, cursor::Show);
}

/// Holds the terminal in raw mode on the alternate screen until dropped.
struct Session;

impl Session {
    fn enter() -> Result<Session, std::io::Error> {
        terminal::enable_raw_mode()?;
        let session = Session;
        execute!(
            std::io::stdout(),
            EnterAlternateScreen,
            terminal::Clear(terminal::ClearType::All),
            cursor::Hide
        )?;
        // A panic (a bug) leaves the terminal usable: restored before the message.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
        Ok(session)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        restore();
    }
}

/// The key `event` means, if it is a key press.
fn key_of(event: &KeyEvent) -> Option<Key> {
    if event.kind != KeyEventKind::Press {
        return None;
    }
    Some(match event.code {
        KeyCode::Char('c') if event.modifiers.contains(KeyModifiers::CONTROL) => Key::CtrlC,
        KeyCode::Char(c) => Key::Char(c),
        KeyCode::Esc => Key::Esc,
        _ => Key::Other,
    })
}

/// Asks the arbiter at `socket` once a second, sending each answer, until nobody listens.
fn fetcher(socket: PathBuf, answers: mpsc::Sender<Result<Document, FetchError>>) {
    loop {
        if answers.send(fetch_document(&socket)).is_err() {
            return;
        }
        std::thread::sleep(REFRESH);
    }
}

/// The live view, until `q`, Esc or Ctrl-C.
fn live(socket: &Path) -> Result<(), TopError> {
    let (answers, fetched) = mpsc::channel();
    let path = socket.to_path_buf();
    std::thread::Builder::new().name("gpufrac-top-fetch".into()).spawn(move || fetcher(path, answers))?;
    let session = Session::enter()?;
    // Not `Terminal::clear`, which asks the terminal where its cursor is: the alternate
    // screen is cleared on entering instead.
    let mut terminal = Terminal::new(CrosstermBackend::new(std::io::stdout()))?;
    let mut app = App::new(socket);
    let mut drawn: Option<Instant> = None;
    let mut dirty = true;
    loop {
        while let Ok(answer) = fetched.try_recv() {
            app.update(answer, now_ms());
            dirty = true;
        }
        // "updated 3s ago" moves on even when nothing else does.
        if dirty || drawn.is_none_or(|t| t.elapsed() >= REFRESH) {
            let view = app.view(now_ms());
            terminal.draw(|frame| render::draw(frame, &view))?;
            drawn = Some(Instant::now());
            dirty = false;
        }
        if !event::poll(KEY_WAIT)? {
            continue;
        }
        match event::read()? {
            Event::Key(key) => {
                if let Some(key) = key_of(&key) {
                    if app.key(key) == Action::Quit {
                        break;
                    }
                    dirty = true;
                }
            }
            Event::Resize(..) => dirty = true,
            _ => {}
        }
    }
    drop(terminal);
    drop(session);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presses_are_keys_ctrl_c_included() {
        let press = |code, modifiers| KeyEvent::new(code, modifiers);
        assert_eq!(key_of(&press(KeyCode::Char('q'), KeyModifiers::NONE)), Some(Key::Char('q')));
        assert_eq!(key_of(&press(KeyCode::Char('c'), KeyModifiers::CONTROL)), Some(Key::CtrlC));
        assert_eq!(key_of(&press(KeyCode::Esc, KeyModifiers::NONE)), Some(Key::Esc));
        assert_eq!(key_of(&press(KeyCode::F(1), KeyModifiers::NONE)), Some(Key::Other));
        let mut release = press(KeyCode::Char('q'), KeyModifiers::NONE);
        release.kind = KeyEventKind::Release;
        assert_eq!(key_of(&release), None);
    }
}
