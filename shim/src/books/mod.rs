//! The books: what the group holds on each device, shared by its processes (the ledger),
//! and what each allocation, context and handle of this process was charged (records).
//! Data only: they decide nothing and call nothing.

pub(crate) mod contexts;
pub mod group_ledger;
pub mod records;
