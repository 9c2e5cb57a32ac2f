//! Logical replication: setup and checks ([`setup`]), the stream ([`stream`]), the writes it
//! has in flight ([`writer`]) and which LSN may be acknowledged ([`ack`]).

pub mod ack;
pub mod setup;
pub mod stream;
pub mod writer;
