//! Stage 1, receive: a delivery as it came off the wire. Nothing in it is trusted yet.

use std::time::Instant;

use byoc_protocol::{JobEnvelope, PollResponse};

pub struct PolledJob {
    pub delivery_id: String,
    pub envelope: JobEnvelope,
    pub received_at: Instant,
}

impl From<PollResponse> for PolledJob {
    fn from(r: PollResponse) -> Self {
        PolledJob { delivery_id: r.delivery_id, envelope: r.envelope, received_at: Instant::now() }
    }
}
