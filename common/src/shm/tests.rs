use super::*;
use std::os::unix::fs::PermissionsExt;

#[repr(C)]
struct Counter(AtomicU64);
// SAFETY: one atomic, C layout.
unsafe impl SharedPlain for Counter {}

/// A fresh folder under the temp dir, removed at drop; the private folder is `dir/p`.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Scratch {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("shm-test-{what}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        Scratch(dir)
    }
    fn private(&self) -> PathBuf {
        self.0.join("p")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open(dir: &Path) -> io::Result<SharedFile<Counter>> {
    SharedFile::<Counter>::open_private(dir, "f", |_| {})
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

fn refused(result: io::Result<SharedFile<Counter>>, path: &Path, why: &str) {
    let err = result.err().unwrap_or_else(|| panic!("{} was used", path.display()));
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()) && text.contains(why), "{text}");
}

const WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// `f` in `dir`, opened with one slot claimed: a member (each open file description
/// counts as one process for the locks).
fn member(dir: &Path, name: &str) -> SharedFile<Counter> {
    let f = SharedFile::<Counter>::open_private(dir, name, |_| {}).unwrap();
    let table = f.lock_table();
    assert!(f.claim_slot(4, &table).is_some());
    drop(table);
    f
}

/// Counts this thread's allocations, so that tests running beside it do not count.
struct Counting;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged; the count is a
// const-initialised thread-local, which itself never allocates.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's guarantees for `layout`, passed on.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `alloc` above, that is from System.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

#[test]
fn the_shims_lock_path_allocates_nothing() {
    // The shim takes the table lock (and checks slots) inside cuMemAlloc and cuMemFree.
    let s = Scratch::new("alloc");
    let a = member(&s.private(), "f");
    let b = open(&s.private()).unwrap();
    let before = ALLOCATIONS.with(|n| n.get());
    for _ in 0..100 {
        let table = a.lock_table();
        assert!(a.slot_alive(0) && !a.slot_alive(1));
        assert!(b.slot_alive(0));
        drop(table);
    }
    assert_eq!(ALLOCATIONS.with(|n| n.get()) - before, 0, "allocations on the lock path");
}

#[test]
fn slots_and_the_table_exclude_other_descriptions_until_given_back() {
    let s = Scratch::new("locks");
    let a = member(&s.private(), "f");
    let b = open(&s.private()).unwrap();
    // a's slot 0 is alive for b, and b is given the next one.
    assert!(b.slot_alive(0), "a holds slot 0");
    assert!(!b.slot_alive(1), "nobody holds slot 1");
    assert!(!b.slot_alive(MAX_SLOTS), "past the last slot");
    let table = b.lock_table();
    assert_eq!(b.claim_slot(4, &table), Some(1));
    assert!(a.slot_alive(1), "b holds slot 1");
    // While b holds the table, a waits for it in vain.
    assert!(a.lock_table_within(WAIT).is_none(), "the table is b's");
    drop(table);
    assert!(a.lock_table_within(WAIT).is_some(), "the table was given back");
    // Given back, a slot is dead for everyone else.
    a.release_slot(0);
    assert!(!b.slot_alive(0), "a gave slot 0 back");
    assert!(any_slot_locked(&a.file, 4).unwrap(), "b's slot 1");
    b.release_slot(1);
    assert!(!any_slot_locked(&a.file, 4).unwrap(), "no slot is held");
}

#[test]
fn a_private_file_is_made_0600_in_a_0700_folder_shared_and_removed_by_its_last_member() {
    let s = Scratch::new("fresh");
    let a = member(&s.private(), "f");
    assert_eq!(mode(&s.private()), 0o700);
    assert_eq!(mode(&s.private().join("f")), 0o600);
    let b = member(&s.private(), "f");
    a.get().0.fetch_add(5, Ordering::Relaxed);
    assert_eq!(b.get().0.load(Ordering::Relaxed), 5, "both map one file");
    assert!(!a.leave_and_remove_if_unused(4, WAIT).unwrap(), "b is still a member");
    assert!(s.private().join("f").exists());
    assert!(b.leave_and_remove_if_unused(4, WAIT).unwrap(), "a gave its slot back");
    assert!(!s.private().join("f").exists());
    assert!(s.private().is_dir(), "the folder stays: its name is not given up to others");
}

#[test]
fn a_file_made_while_a_sweep_removes_the_empty_folder_finds_its_folder() {
    // One thread keeps joining and leaving "f" while another removes the folder
    // whenever it is empty (as `ledgers::sweep` does, here every 50 µs): every join
    // succeeds.
    let s = Scratch::new("leave-join");
    let private = s.private();
    let done = std::sync::atomic::AtomicBool::new(false);
    struct Done<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let _ = std::fs::remove_dir(&private);
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        });
        // Stops the remover however this thread ends, a failed join included.
        let _done = Done(&done);
        for round in 0..500 {
            let m = SharedFile::<Counter>::open_private(&private, "f", |_| {})
                .unwrap_or_else(|e| panic!("joining in round {round}: {e}"));
            let table = m.lock_table();
            assert!(m.claim_slot(4, &table).is_some());
            drop(table);
            m.leave_and_remove_if_unused(4, WAIT).unwrap();
        }
    });
}

#[test]
fn two_members_leaving_at_once_leave_nothing() {
    let s = Scratch::new("together");
    for round in 0..20 {
        let (a, b) = (member(&s.private(), "f"), member(&s.private(), "f"));
        let start = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            for m in [&a, &b] {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    m.leave_and_remove_if_unused(4, WAIT).unwrap()
                });
            }
        });
        assert!(!s.private().join("f").exists(), "round {round}: the file was left");
    }
}

#[test]
fn a_sweep_removes_files_whose_members_died_and_keeps_the_rest() {
    let s = Scratch::new("sweep");
    let dir = s.private();
    // Members that died: their descriptions are closed, so their locks are gone.
    drop(member(&dir, "dead.x"));
    drop(member(&dir, "dead2.x"));
    let live = member(&dir, "live.x");
    let other = member(&dir, "other.y");
    drop(other);
    // Not ours to judge: a file with another mode.
    let odd = dir.join("odd.x");
    std::fs::write(&odd, [0u8; 8]).unwrap();
    std::fs::set_permissions(&odd, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(sweep_dead(&dir, ".x", 4).unwrap(), 2);
    assert!(!dir.join("dead.x").exists() && !dir.join("dead2.x").exists());
    assert!(dir.join("live.x").exists(), "a live member's file is kept");
    assert!(dir.join("other.y").exists(), "another suffix is not looked at");
    assert!(odd.exists());
    // A file whose table someone holds (a joiner) is left alone.
    let joining = SharedFile::<Counter>::open_private(&dir, "joining.x", |_| {}).unwrap();
    let table = joining.lock_table();
    assert_eq!(sweep_dead(&dir, ".x", 4).unwrap(), 0);
    drop(table);
    drop(live);
    assert_eq!(sweep_dead(&dir, ".x", 4).unwrap(), 2, "joining.x and live.x, now dead");
    assert!(!dir.join("live.x").exists());
    assert_eq!(sweep_dead(&s.0.join("missing"), ".x", 4).unwrap(), 0);
}

#[test]
fn a_symbolic_link_is_never_followed() {
    let s = Scratch::new("link");
    let target = s.0.join("target");
    std::fs::write(&target, b"precious").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    // A link where the file would be.
    std::fs::create_dir(s.private()).unwrap();
    std::fs::set_permissions(s.private(), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&target, s.private().join("f")).unwrap();
    refused(open(&s.private()), &s.private().join("f"), "symbolic link");
    // A link where the folder would be, to a folder that would pass every check.
    let real = s.0.join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
    let linked = s.0.join("linked");
    std::os::unix::fs::symlink(&real, &linked).unwrap();
    refused(open(&linked), &linked, "symbolic link");
    assert!(std::fs::read_dir(&real).unwrap().next().is_none(), "nothing made through the link");
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
}

#[test]
fn files_and_folders_with_another_mode_or_owner_or_links_are_not_adopted() {
    let s = Scratch::new("modes");
    // A folder anyone may write to.
    std::fs::create_dir(s.private()).unwrap();
    std::fs::set_permissions(s.private(), std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(open(&s.private()), &s.private(), "mode is 0777");
    std::fs::set_permissions(s.private(), std::fs::Permissions::from_mode(0o700)).unwrap();
    // A file anyone may read and write.
    let f = s.private().join("f");
    std::fs::write(&f, [0u8; 8]).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused(open(&s.private()), &f, "mode is 0666");
    // A second name for the file.
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::hard_link(&f, s.0.join("other-name")).unwrap();
    refused(open(&s.private()), &f, "2 hard links");
    std::fs::remove_file(s.0.join("other-name")).unwrap();
    // Not a regular file.
    std::fs::remove_file(&f).unwrap();
    std::fs::create_dir(&f).unwrap();
    refused(open(&s.private()), &f, "not a regular file");
    std::fs::remove_dir(&f).unwrap();
    assert!(open(&s.private()).is_ok(), "a clean folder works");
    // Another user's file and folder (only root can make them).
    if euid() == 0 {
        std::os::unix::fs::chown(&f, Some(65534), None).unwrap();
        refused(open(&s.private()), &f, "uid 65534");
        std::fs::remove_file(&f).unwrap();
        std::os::unix::fs::chown(s.private(), Some(65534), None).unwrap();
        refused(open(&s.private()), &s.private(), "uid 65534");
    }
}
