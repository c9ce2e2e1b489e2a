//! `cuInit`, and the one place where the layers are wired and started: the real driver
//! first, then the shim's configuration and the devices' slices; with an arbiter, the
//! client's connection and registration, the one route of what it pushes, the lender the
//! enforcer asks for loans, and the compute lease, swap and parking workers. A bad
//! setting fails `cuInit` with `CUDA_ERROR_NOT_INITIALIZED` and one line on stderr.

use std::ffi::c_uint;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufrac_common::protocol::{DeviceId, Reply};

use crate::control::arbiter::{self, Client, Event, Registration, RouteFn};
use crate::control::{compute, gate, give_back, park, swap};
use crate::driver::ffi::{Status, NOT_INITIALIZED, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::{mode, Enforcer, Lender, Mode, NotGranted, Slice};

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
        Mode::Enforcing(e) => match e.init_devices(connect) {
            Ok(_) => SUCCESS,
            Err(message) => {
                report_once(message);
                NOT_INITIALIZED
            }
        },
    }
}

/// Registers with the arbiter, if one is configured; a refusal fails `cuInit`. The
/// slices take the request and limit the arbiter believes (what this process is
/// entitled to, when that is less than it declared): the process sees and keeps to
/// its entitlement, not to what its environment says. If the arbiter cannot be
/// reached at `cuInit`, or believes nothing (0 and 0), the declared slices stand (the
/// arbiter still refuses bursts past the entitlement).
fn connect(e: &'static Enforcer, slices: &mut [Slice]) -> Result<(), String> {
    let Some(socket) = &e.config.arbiter_socket else { return Ok(()) };
    // The gate calls up only through what is registered with it.
    gate::register_holder(gate::Holder { parked: park::parked, wanted: swap::wanted });
    gate::register_lease(compute::at_the_gate());
    let hello = e.hello();
    if e.config.park_after.is_some() {
        // Before the handshake: an admission parked closes the gate at once.
        park::enable();
    }
    let ledger_of: Vec<([u8; 16], usize)> = slices.iter().map(|s| (s.uuid, s.ledger)).collect();
    let usage = Box::new(move |device: &[u8; 16]| {
        ledger_of.iter().find(|(u, _)| u == device).map_or((0, 0, 0), |&(_, dev)| {
            // Host bytes first: it waits for a swap under way to finish.
            let swapped = swap::host_bytes(dev);
            (e.ledger.held_by_me(dev), e.ledger.my_granted(dev), swapped)
        })
    });
    let client = Client::connect(socket, hello, usage, route(e));
    // The group's fractions are of what the arbiter manages of each GPU, and its
    // device is no larger (`gpufrac-arbiter --gpu-memory`).
    for (ordinal, slice) in slices.iter_mut().enumerate() {
        if let Some(managed) = client.managed(&slice.uuid).filter(|&managed| managed < slice.total) {
            *slice = e.slice_for(Some(ordinal), &slice.uuid, managed, true)?;
            tracing::info!(
                ordinal,
                request = slice.request,
                limit = slice.limit,
                managed,
                "device slice of the memory the arbiter manages"
            );
        }
    }
    // GPUFRAC_RESERVE=first-use: nothing is reserved until the process's first context on
    // a device (`Enforcer::reserve_on_first_use`).
    let first_use = e.reserves_on_first_use();
    let registrations = slices
        .iter()
        .map(|s| Registration {
            device: s.uuid,
            total: s.total,
            request: if first_use { 0 } else { s.request },
            limit: s.limit,
        })
        .collect();
    client.start(registrations)?;
    if let Some(pid) = client.seen_pid() {
        e.ledger.set_host_pid(pid);
    }
    for slice in slices.iter_mut() {
        // Nothing believed at all (not entitled, or the arbiter could not decide yet):
        // a slice of nothing would leave the process without memory for its whole
        // life, so the declared one stands; the arbiter counts what it uses past its
        // entitlement as outside gpufrac and lends it nothing. Only (0, 0) means that:
        // a limit alone registers (0, limit) and is believed as (0, limit) or less.
        // Declared (0, limit) and believed (0, 0), it keeps its view of the limit but
        // has nothing it may use without a grant, and none comes (out-of-memory).
        let believed = client.believed(&slice.uuid).filter(|&believed| believed != (0, 0));
        if let Some((request, limit)) = believed {
            let limit = limit.min(slice.limit);
            // Reserved at first use, the request is believed then.
            let request =
                if first_use { slice.request.min(limit) } else { request.min(slice.request).min(limit) };
            if (request, limit) != (slice.request, slice.limit) {
                tracing::info!(request, limit, "device slice as the arbiter believes it");
            }
            (slice.request, slice.limit) = (request, limit);
        }
    }
    for slice in slices.iter() {
        // A context's size as the arbiter learnt it on this GPU: the first context's
        // charge, where the group has measured none itself.
        if let Some(bytes) = client.context_bytes(&slice.uuid) {
            if e.ledger.context_bytes(slice.ledger).is_none() {
                e.ledger.set_context_bytes(slice.ledger, bytes);
            }
        }
    }
    arbiter::install(client.clone());
    let _ = e.lender.set(Box::new(Loans(client.clone())));
    if e.config.compute.is_some() {
        let devices: Vec<[u8; 16]> = slices.iter().map(|s| s.uuid).collect();
        compute::start(client.clone(), &devices)?;
    }
    if e.config.resolver == gpufrac_common::Resolver::Swap || park::parkable() {
        swap::start(e, client)?;
    }
    Ok(())
}

/// Where everything the arbiter client hands up goes.
fn route(e: &'static Enforcer) -> RouteFn {
    let idle = Mutex::new(give_back::IdleWatch::new());
    Box::new(move |event| match event {
        Event::Pushed(Reply::Reclaim { device }) => {
            if let Some(slice) = e.slice_by_uuid(device) {
                e.give_back(&slice, 0);
                // What the frameworks keep and do not use follows, from their pools.
                give_back::ask(e, give_back::Why::Asked);
            }
        }
        Event::Pushed(Reply::SwapOut { device }) => swap::swap_out_requested(*device),
        Event::Pushed(Reply::Resume { .. }) => swap::resume_offered(),
        Event::Pushed(Reply::Park { device, checkpoint }) => swap::park_requested(*device, *checkpoint),
        Event::Pushed(Reply::Unparked { device }) => swap::unpark_pushed(*device),
        Event::Pushed(Reply::Lease { device, state }) => compute::told(*device, *state),
        Event::Pushed(other) => tracing::debug!("arbiter says {other:?}"),
        Event::AdmittedParked(device) => park::admitted_parked(device),
        Event::Reconnected => compute::rejoin(),
        Event::Disconnected => compute::forget(),
        Event::Tick { activity } => {
            if let Some(e) = crate::enforcer::enforcer() {
                idle.lock().unwrap_or_else(|p| p.into_inner()).tick(e, activity);
            }
        }
    })
}

/// The arbiter client as the enforcer's lender.
struct Loans(Arc<Client>);

impl Lender for Loans {
    fn acquire(
        &self,
        device: DeviceId,
        bytes: u64,
        preferred: u64,
        held: u64,
        timeout: Duration,
    ) -> Result<u64, NotGranted> {
        self.0.acquire(device, bytes, preferred, held, timeout, false)
    }

    fn release(&self, device: DeviceId, bytes: u64, held: u64) {
        self.0.release(device, bytes, held);
    }

    fn contended(&self, device: &DeviceId) -> bool {
        self.0.contended(device)
    }

    fn swapped_out(&self) -> bool {
        swap::swapped_out()
    }

    fn wait_swapped_in(&self) -> Result<(), Status> {
        gate::wait_swapped_in()
    }

    fn reserve(&self, device: DeviceId, total: u64, request: u64, limit: u64) -> Result<u64, String> {
        self.0.register_again(Registration { device, total, request, limit }).map(|(request, _)| request)
    }
}
