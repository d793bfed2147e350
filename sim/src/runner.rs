//! Runs the engine on its own OS thread in (scaled) real time.
//!
//! The engine's work is CPU-bound and must not starve the HTTP tasks, so it
//! gets a thread of its own. After each step it sleeps the modelled step
//! time multiplied by the time scale, then delivers the step's tokens and
//! hands its events to the publisher.

use crate::engine::{Engine, NewRequest};
use crate::faults::Faults;
use crate::metrics::Snapshot;
use crate::publisher::PublisherCmd;
use parking_lot::Mutex;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

/// Messages to the engine thread.
#[derive(Debug)]
pub enum Command {
    /// A new request; `arrived` is its wall-clock arrival.
    Add(NewRequest, Instant),
    /// The client went away.
    Abort(u64),
    /// `reset_prefix_cache`; answers whether it happened.
    ResetCache(oneshot::Sender<bool>),
}

/// Handle to a running engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    snapshot: Arc<Mutex<Snapshot>>,
}

impl EngineHandle {
    /// Sends a command; false when the engine thread is gone.
    pub fn send(&self, c: Command) -> bool {
        self.tx.send(c).is_ok()
    }

    /// The latest published view of the engine.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot.lock().clone()
    }
}

/// Starts the engine thread.
pub fn spawn(
    engine: Engine,
    time_scale: f64,
    faults: Arc<Faults>,
    events: UnboundedSender<PublisherCmd>,
) -> EngineHandle {
    let (tx, rx) = std::sync::mpsc::channel();
    let snapshot = Arc::new(Mutex::new(Snapshot::default()));
    let snap2 = snapshot.clone();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || run(engine, rx, time_scale, faults, events, snap2))
        .expect("spawn engine thread");
    EngineHandle { tx, snapshot }
}

struct Clock {
    scale: f64,
    step_wall_start: Instant,
    step_virtual_start: f64,
}

impl Clock {
    /// Virtual time of a wall-clock arrival: inside the step in flight when
    /// it arrived, interpolated by the time scale; at the current virtual
    /// time if the engine was idle.
    fn virtual_arrival(&self, arrived: Instant, now_virtual: f64) -> f64 {
        if self.scale <= 0.0 || arrived < self.step_wall_start {
            return now_virtual;
        }
        let d = arrived.duration_since(self.step_wall_start).as_secs_f64() / self.scale;
        (self.step_virtual_start + d).min(now_virtual)
    }
}

fn run(
    mut engine: Engine,
    rx: Receiver<Command>,
    scale: f64,
    faults: Arc<Faults>,
    events: UnboundedSender<PublisherCmd>,
    snapshot: Arc<Mutex<Snapshot>>,
) {
    let mut clock = Clock {
        scale,
        step_wall_start: Instant::now(),
        step_virtual_start: 0.0,
    };
    let mut deadline = Instant::now();
    let mut last_snapshot = Instant::now() - Duration::from_secs(1);
    loop {
        // Take every queued command; block only when there is nothing to do.
        let mut first = None;
        if !engine.has_work() {
            publish_snapshot(&engine, &snapshot);
            match rx.recv() {
                Ok(c) => first = Some(c),
                Err(_) => return,
            }
            // Idle time does not count against latency.
            deadline = Instant::now();
        }
        let handle = |c: Command, engine: &mut Engine| match c {
            Command::Add(mut r, arrived) => {
                r.arrival = clock.virtual_arrival(arrived, engine.now());
                engine.add_request(r);
            }
            Command::Abort(id) => {
                engine.abort(id);
            }
            Command::ResetCache(reply) => {
                let ev = engine.reset_prefix_cache();
                let ok = ev.is_some();
                if let Some(ev) = ev {
                    let _ = events.send(PublisherCmd::Batch(vec![ev]));
                }
                let _ = reply.send(ok);
            }
        };
        if let Some(c) = first {
            handle(c, &mut engine);
        }
        loop {
            match rx.try_recv() {
                Ok(c) => handle(c, &mut engine),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
            }
        }
        if let Some(until) = faults.stall_until() {
            publish_snapshot(&engine, &snapshot);
            // Stay responsive to new commands while stalled.
            match rx.recv_timeout(
                until
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(50)),
            ) {
                Ok(c) => handle(c, &mut engine),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            deadline = Instant::now();
            continue;
        }
        if !engine.has_work() {
            continue;
        }

        clock.step_wall_start = Instant::now();
        clock.step_virtual_start = engine.now();
        let out = engine.step();
        if scale > 0.0 {
            deadline = deadline.max(clock.step_wall_start) + out.duration.mul_f64(scale);
            let now = Instant::now();
            if deadline > now {
                std::thread::sleep(deadline - now);
            }
        }
        for (sink, tok) in out.tokens {
            // A closed sink means the client left; its abort is on the way.
            let _ = sink.send(tok);
        }
        if !out.events.is_empty() {
            let _ = events.send(PublisherCmd::Batch(out.events));
        }
        if last_snapshot.elapsed() >= Duration::from_millis(2) {
            publish_snapshot(&engine, &snapshot);
            last_snapshot = Instant::now();
        }
    }
}

fn publish_snapshot(engine: &Engine, snapshot: &Mutex<Snapshot>) {
    let s = Snapshot {
        stats: engine.stats().clone(),
        running: engine.num_running(),
        waiting: engine.num_waiting(),
        kv_usage: engine.pool().usage(),
        cached_blocks: engine.pool().cached_blocks(),
        virtual_time: engine.now(),
    };
    *snapshot.lock() = s;
}
