//! Exported VMM memory on the shared machine: charged once, to its owner; ownership passes
//! on when the owner lets go; open exported descriptors keep it alive, charged to no
//! process; a dead holder's share passes on too.

use std::os::fd::AsFd;

use simgpu_state::objects::{backing_file, ObjectError};
use simgpu_state::Machine;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

fn temp_state(name: &str) -> String {
    let path = std::env::temp_dir().join(format!("simgpu-objects-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path.to_string_lossy().into_owned()
}

/// What NVML would list for slot holders: the machine's per-process figures are by PID,
/// and both slots here are this process, so the test reads each slot's own `held`.
/// Asserts that `slot` can charge exactly `room` more bytes on device 0: what a charge
/// decides by (the device's charged total), which must follow every change of owner.
fn assert_room(slot: &simgpu_state::ProcessSlot<'_>, room: u64) {
    assert!(slot.charge(0, room + 1).is_err(), "more than {room} bytes of room");
    slot.charge(0, room).unwrap_or_else(|e| panic!("{room} bytes should fit: {e:?}"));
    slot.release(0, room);
}

#[test]
fn ownership_follows_the_holders_and_open_exports_keep_the_memory() {
    let state = temp_state("owner");
    let machine = Machine::open(&state, &[1024 * MIB]).expect("open");
    // Two slots in one process stand for two processes (as a private dlmopen copy does).
    let exporter = machine.attach().expect("attach");
    let importer = machine.attach().expect("attach");
    exporter.charge(0, SIZE).expect("the allocation fits");
    let file = backing_file(&state, SIZE).expect("a backing file");
    let (id, fd) = exporter.export_object(None, file.as_fd(), 0, SIZE, 1).expect("export");
    let object = importer.import_object(fd.as_fd()).expect("import");
    assert_eq!((object.id, object.device, object.size, object.handle_types), (id, 0, SIZE, 1));
    assert_eq!((exporter.held(0), importer.held(0)), (SIZE, 0), "charged to its maker only");
    assert_eq!(machine.used(0), SIZE, "the device counts it once");
    assert!(exporter.owns_object(id) && !importer.owns_object(id));

    // The maker lets go while the exported descriptor is still open: the export's
    // reference comes first and belongs to no process.
    exporter.leave_object(id);
    assert_eq!((exporter.held(0), importer.held(0)), (0, 0), "owned by the open descriptor");
    assert_eq!(machine.used(0), SIZE, "still alive, still counted");
    assert_room(&exporter, 1024 * MIB - SIZE);

    // The descriptor closes: the importer owns it now.
    drop(fd);
    assert_eq!(machine.used(0), SIZE);
    assert_eq!(importer.held(0), SIZE, "the last holder is charged");
    assert!(importer.owns_object(id));

    importer.leave_object(id);
    assert_eq!(machine.used(0), 0, "nobody holds it: freed");
    assert_room(&exporter, 1024 * MIB);
    assert!(!std::path::Path::new(&machine.object_path(id)).exists(), "its name is gone");
    drop(file);
    let _ = simgpu_state::remove_state(&state);
}

#[test]
fn only_exported_descriptors_keep_it_and_a_dead_owner_passes_it_on() {
    let state = temp_state("orphan");
    let machine = Machine::open(&state, &[1024 * MIB]).expect("open");
    let exporter = machine.attach().expect("attach");
    exporter.charge(0, SIZE).expect("fits");
    let file = backing_file(&state, SIZE).expect("a backing file");
    let (id, fd) = exporter.export_object(None, file.as_fd(), 0, SIZE, 1).expect("export");
    exporter.leave_object(id);
    drop(file);
    assert_eq!(machine.used(0), SIZE, "an open exported descriptor keeps the memory");
    assert!(machine.processes(0).iter().all(|p| p.used == 0), "listed under no process");
    drop(fd);
    assert_eq!(machine.used(0), 0, "the last descriptor closed: freed");

    // An owner slot that goes away (as a process that exits) passes the memory on.
    let importer = machine.attach().expect("attach");
    let owner = machine.attach().expect("attach");
    owner.charge(0, SIZE).expect("fits");
    let file = backing_file(&state, SIZE).expect("a backing file");
    let (id, fd) = owner.export_object(None, file.as_fd(), 0, SIZE, 1).expect("export");
    importer.import_object(fd.as_fd()).expect("import");
    drop(fd);
    drop(owner);
    assert_eq!(importer.held(0), SIZE, "the importer inherits the charge");
    assert_eq!(machine.used(0), SIZE);
    assert_room(&importer, 1024 * MIB - SIZE);
    importer.leave_object(id);
    assert_eq!(machine.used(0), 0);
    assert_room(&importer, 1024 * MIB);
    let _ = simgpu_state::remove_state(&state);
}

#[test]
fn a_foreign_descriptor_is_not_an_object() {
    let state = temp_state("foreign");
    let machine = Machine::open(&state, &[1024 * MIB]).expect("open");
    let slot = machine.attach().expect("attach");
    let file = std::fs::File::open("/proc/self/status").expect("a file");
    assert!(matches!(slot.import_object(file.as_fd()), Err(ObjectError::Unknown)));
    let _ = simgpu_state::remove_state(&state);
}
