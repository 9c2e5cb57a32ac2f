//! The task settings of `run` (queue, routes, asynq options, payload format), as flags of the
//! operator commands that build or look for tasks (`trace`, `replay`, `reconcile`). Same flags,
//! same `OUTBOX_*` variables, same defaults as `run`: given the relay's environment, these
//! commands route and build exactly the tasks the relay does.

use crate::config::{
    parse_duration, parse_nonempty, parse_positive_duration, parse_routes, parse_size, QueueRoutes,
};
use crate::task::{PayloadFormat, TaskSettings};
use clap::Args;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct TaskArgs {
    /// The asynq queue tasks go to unless a route matches (as in `run`).
    #[arg(long, env = "OUTBOX_QUEUE", default_value = "default", value_parser = parse_nonempty)]
    pub queue: String,
    /// Routes event names to queues: `order.placed=critical,user.*=low` (as in `run`).
    #[arg(long, env = "OUTBOX_QUEUE_ROUTES", default_value = "", value_parser = parse_routes)]
    pub queue_routes: QueueRoutes,
    /// asynq MaxRetry of each task (as in `run`).
    #[arg(long, env = "OUTBOX_TASK_MAX_RETRY", default_value_t = 25, value_parser = clap::value_parser!(i32).range(0..))]
    pub task_max_retry: i32,
    /// asynq task timeout (as in `run`).
    #[arg(long, env = "OUTBOX_TASK_TIMEOUT", default_value = "30m", value_parser = parse_positive_duration)]
    pub task_timeout: Duration,
    /// How long asynq keeps a completed task (as in `run`).
    #[arg(long, env = "OUTBOX_TASK_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub task_retention: Duration,
    /// Task type prefix (as in `run`).
    #[arg(long, env = "OUTBOX_TASK_TYPE_PREFIX", default_value = "event:")]
    pub task_type_prefix: String,
    /// Task payload format (as in `run`).
    #[arg(long, env = "OUTBOX_PAYLOAD_FORMAT", value_enum, default_value_t = PayloadFormat::Envelope)]
    pub payload_format: PayloadFormat,
    /// Rows with a larger payload are not tasks (as in `run`).
    #[arg(long, env = "OUTBOX_MAX_PAYLOAD_BYTES", default_value = "1MiB", value_parser = parse_size)]
    pub max_payload_bytes: usize,
}

impl TaskArgs {
    /// The task settings, as [`crate::config::RunArgs::task_settings`] builds them.
    pub fn settings(&self) -> TaskSettings {
        TaskSettings {
            type_prefix: self.task_type_prefix.clone(),
            payload_format: self.payload_format,
            default_queue: Arc::from(self.queue.as_str()),
            routes: self.queue_routes.0.clone(),
            max_retry: self.task_max_retry,
            timeout_secs: i64::try_from(self.task_timeout.as_secs())
                .unwrap_or(i64::MAX)
                .max(1),
            retention_secs: i64::try_from(self.task_retention.as_secs()).unwrap_or(i64::MAX),
            max_payload_bytes: self.max_payload_bytes,
        }
    }
}
