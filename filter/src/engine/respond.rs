//! The response side of a request's flow: status, timings, usage, the
//! id of a stored Responses API response, and the reports to the indexer.

use std::rc::Rc;

use kvasir_proto::v1::{Outcome, ReportPhase};

use super::{DeferredCall, Flow, Host, Phase, Verdict};
use crate::pick::{self, Admission, ReportInput};
use crate::response::ResponseTracker;
use crate::stats::{ns_to_ms, response_class};

/// When a report is dispatched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dispatch {
    /// At once, from the callback (before Envoy passes the chunk on).
    Now,
    /// Queued for the root's tick or the stream's log (see `report`).
    Deferred,
}

impl Flow {
    /// Response headers: status, streaming or not, which endpoint served.
    pub fn on_response_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Verdict {
        if self.phase != Phase::Forwarded {
            return Verdict::Continue;
        }
        let s = &self.shared.config.settings;
        self.status = host.response_header(":status").and_then(|v| v.parse().ok());
        let streaming = host.response_header("content-type").is_some_and(|c| {
            c.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        });
        let upstream_said = host.response_header(&s.served_header);
        self.served = upstream_said
            .clone()
            .or_else(|| host.upstream_address())
            .or_else(|| {
                self.routed
                    .as_ref()
                    .and_then(|r| r.picked.as_ref())
                    .map(|p| p.first.clone())
            });
        if s.expose_served_endpoint && upstream_said.is_none() {
            if let Some(addr) = &self.served {
                host.add_response_header(&s.served_header, addr);
            }
        }
        // Every response of a rate-limited tenant tells its budget.
        for (name, value) in &self.rate_limit_headers {
            host.add_response_header(name, value);
        }
        let tracker = ResponseTracker::new(self.start_ns, streaming, s.response_body_limit_bytes);
        self.tracker = Some(if self.learn_response_id && self.ok_status() {
            tracker.with_response_id()
        } else {
            tracker
        });
        if end_of_stream {
            self.finish(host, true);
        }
        Verdict::Continue
    }

    fn ok_status(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// A response body chunk.
    pub fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        size: usize,
        end_of_stream: bool,
    ) -> Verdict {
        if self.phase != Phase::Forwarded {
            return Verdict::Continue;
        }
        let chunk = if size > 0 {
            host.response_body(size).unwrap_or_default()
        } else {
            Vec::new()
        };
        let now = host.now_ns();
        let (mut first, mut id_seen) = (false, false);
        if let Some(t) = &mut self.tracker {
            let ev = t.feed(&chunk, now);
            (first, id_seen) = (ev.first, ev.response_id);
            if let (Some(itl), true) = (ev.itl_ns, self.ok_status()) {
                self.shared
                    .stats
                    .record(&format!("{}.itl_ms", self.prefix()), ns_to_ms(itl));
            }
        }
        if id_seen {
            // Sent before Envoy passes this chunk on, so the indexer knows
            // where the response is stored before the client knows its id
            // (a follow-up sent at once must not race the report).
            self.report(
                host,
                ReportPhase::FirstToken,
                Outcome::Unspecified,
                None,
                now,
                Dispatch::Now,
            );
        } else if first
            && !self.learn_response_id
            && self.ok_status()
            && self.routed.as_ref().is_some_and(|r| r.report_first_token)
        {
            self.report(
                host,
                ReportPhase::FirstToken,
                Outcome::Unspecified,
                None,
                now,
                Dispatch::Deferred,
            );
        }
        if !end_of_stream {
            self.report_usage_if_due(host, now);
        }
        if end_of_stream {
            self.finish(host, true);
        }
        Verdict::Continue
    }

    /// While a budgeted request's answer streams, its usage so far settles
    /// the tenant's reservation: a `USAGE` report every
    /// [`crate::governance::USAGE_EVERY_EVENTS`] content events or
    /// [`crate::governance::USAGE_EVERY_NS`], queued like the first-token
    /// report (the done report covers the end).
    fn report_usage_if_due(&mut self, host: &mut dyn Host, now: u64) {
        let picked = self.routed.as_ref().is_some_and(|r| r.picked.is_some());
        if self.budget_key.is_none() || !picked || !self.ok_status() || self.stored {
            return;
        }
        let Some(t) = self.tracker.as_ref().filter(|t| t.streaming()) else {
            return;
        };
        let Some(usage) = t.usage_so_far() else {
            return;
        };
        if !self.usage_cadence.due(t.content_events(), usage, now) {
            return;
        }
        self.count("usage_reports", 1);
        self.report(
            host,
            ReportPhase::Usage,
            Outcome::Unspecified,
            Some(usage),
            now,
            Dispatch::Deferred,
        );
    }

    /// Response trailers: the response ended (gRPC-style upstreams end
    /// with trailers instead of an end-of-stream body chunk).
    pub fn on_response_trailers(&mut self, host: &mut dyn Host) -> Verdict {
        if self.phase == Phase::Forwarded && self.tracker.is_some() {
            self.finish(host, true);
        }
        Verdict::Continue
    }

    /// The stream is done (always called): accounts a response that did not
    /// end normally (client gone, reset).
    pub fn on_log(&mut self, host: &mut dyn Host) {
        if self.phase == Phase::Forwarded || matches!(self.phase, Phase::Picking(_)) {
            // Response bytes already went to the client, so Envoy could
            // not retry: the engine (or the connection to it) cut the
            // stream. Counted apart from clients that went away.
            self.cut = self.tracker.is_some()
                && host
                    .response_code_details()
                    .is_some_and(|d| d.starts_with("upstream_reset_after_response_started"));
            self.finish(host, false);
        }
        // The stream is complete: its done report (queued at the
        // response's end) and anything else still queued go now.
        self.send_queued(host);
    }

    pub(super) fn finish(&mut self, host: &mut dyn Host, completed: bool) {
        if self.phase == Phase::Done {
            return;
        }
        self.phase = Phase::Done;
        let now = host.now_ns();
        let e2e = now.saturating_sub(self.start_ns);
        let class = if self.cut {
            "cut"
        } else {
            response_class(self.status, completed)
        };
        self.count(&format!("responses.{class}"), 1);
        let ok = completed && self.ok_status();
        let (usage, ttft) = match &mut self.tracker {
            Some(t) => (t.usage(), t.ttft_ns()),
            None => (None, None),
        };
        // A stored response's body repeats the usage charged when it was
        // made. A response that ended without its usage (the client went
        // away, the engine cut it, or it was never asked for) is charged
        // what it surely cost.
        let usage = usage
            .or_else(|| self.usage_without_report())
            .filter(|_| !self.stored);
        self.end_local(host, usage);
        if ok {
            let stats = Rc::clone(&self.shared.stats);
            let p = self.prefix();
            if let Some(t) = ttft {
                stats.record(&format!("{p}.ttft_ms"), ns_to_ms(t));
            }
            stats.record(&format!("{p}.e2e_ms"), ns_to_ms(e2e));
        }
        if let Some(u) = usage {
            self.count("prompt_tokens.cached", u.cached_tokens);
            self.count(
                "prompt_tokens.uncached",
                u.prompt_tokens.saturating_sub(u.cached_tokens),
            );
            self.count("completion_tokens", u.completion_tokens);
        }
        let outcome = if self.cut {
            Outcome::Error
        } else if !completed {
            Outcome::Cancelled
        } else if self.status == Some(504) {
            Outcome::Timeout
        } else if ok {
            Outcome::Success
        } else if self.status.is_some_and(|s| (400..500).contains(&s)) {
            // The request's fault, not the engine's: a tenant sending
            // invalid requests must not make an engine look failing.
            Outcome::ClientError
        } else {
            Outcome::Error
        };
        self.report(
            host,
            ReportPhase::Done,
            outcome,
            usage,
            now,
            Dispatch::Deferred,
        );
    }

    /// The usage of a response that carried none, from what passed
    /// through: the prompt as counted (the engine computed it before its
    /// first token) and at least the content events the client was sent
    /// (each carries one token or more). `None` before any content: nothing
    /// is known to have been generated.
    fn usage_without_report(&self) -> Option<pick::Usage> {
        let so_far = self.tracker.as_ref()?.usage_so_far()?;
        Some(pick::Usage {
            prompt_tokens: so_far.prompt_tokens.max(self.prompt_estimate),
            ..so_far
        })
    }

    /// Dispatches the calls still queued for the root's tick (this VM's,
    /// any request's), in order.
    pub(super) fn send_queued(&self, host: &mut dyn Host) {
        for call in host.take_deferred() {
            let sent = host.call_detached(&call);
            self.shared.count_report(&call.pool_name, sent);
        }
    }

    pub(super) fn report(
        &self,
        host: &mut dyn Host,
        phase: ReportPhase,
        outcome: Outcome,
        usage: Option<pick::Usage>,
        now: u64,
        send: Dispatch,
    ) {
        let s = &self.shared.config.settings;
        let Some(r) = &self.routed else { return };
        let response_id = self
            .tracker
            .as_ref()
            .and_then(ResponseTracker::response_id)
            .unwrap_or_default();
        // A budgeted request always reports (its reservation must be
        // settled and released), and reports its end even when its pick
        // failed open (the indexer may have reserved before the filter gave
        // up); a refused pick's end is reported as rejected.
        // A dispatched pick's end is reported whatever became of its
        // answer: the indexer may have placed it (or reserved for it)
        // after the filter stopped waiting, and ends it when told the
        // request was admitted without it. So is a request the filter
        // admitted itself, whose usage the indexer then charges.
        let budgeted = self.budget_key.is_some();
        let placed = match phase {
            ReportPhase::Done => {
                r.picked.is_some() || self.pick_dispatched || self.admitted_locally
            }
            _ => r.picked.is_some(),
        };
        let accounted = (s.report || budgeted) && placed && !self.request_id.is_empty();
        let admission = if !self.answer_used && (self.pick_dispatched || self.admitted_locally) {
            Admission::Local
        } else {
            Admission::Unspecified
        };
        // The report of a stored response's id goes even for a request
        // that failed open or with reports off: without it every follow-up
        // would be answered as an unknown id.
        let tells_id = send == Dispatch::Now && !response_id.is_empty();
        if !accounted && !tells_id {
            return;
        }
        let ttft = self.tracker.as_ref().and_then(ResponseTracker::ttft_ns);
        let ms = |ns: u64| ns as f64 / 1e6;
        let msg = pick::report_request(&ReportInput {
            pool: &r.indexer_pool,
            request_id: &self.request_id,
            endpoint: self.served.as_deref().unwrap_or_default(),
            usage,
            ttft_ms: ttft.map(ms).unwrap_or(0.0),
            e2e_ms: if phase == ReportPhase::Done {
                ms(now.saturating_sub(self.start_ns))
            } else {
                0.0
            },
            outcome,
            phase,
            response_id,
            budget_key: self.budget_key.as_deref().unwrap_or_default(),
            tenant: self.tenant.as_deref().unwrap_or_default(),
            admission,
        });
        let call = DeferredCall {
            cluster: r.indexer_cluster.clone(),
            method: pick::REPORT,
            msg,
            timeout_ms: s.report_timeout_ms,
            pool_name: r.pool_name.clone(),
        };
        // Reports are queued, not dispatched, from the response's
        // callbacks: a dispatch there (~0.1 ms) runs before Envoy writes the
        // bytes, holding back the first token or the response's end. The
        // first-token report goes on the root's next tick; the done report
        // when the stream is logged (`on_log`), which is also what a
        // follow-up needs: until it arrives the request counts as load on
        // its endpoint, and an agent's next turn sent the moment this
        // response ends would be picked against that stale load, away
        // from its own prefix.
        let call = match send {
            Dispatch::Now => call,
            Dispatch::Deferred => match host.defer_detached(call) {
                Ok(()) => return, // counted when it is dispatched
                Err(call) => call,
            },
        };
        let sent = host.call_detached(&call);
        self.shared.count_report(&r.pool_name, sent);
    }
}
