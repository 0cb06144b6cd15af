//! The gateway's intake stages on the HTTP side: **parse** (admission on a class named by
//! header, then the body read within its limits and the API's adapter), **admit** (the
//! request's class; admission control on the published fleet view), **validate** (model,
//! routing-policy header, session), and scale-from-zero's wait for a worker before placing. The pure stages — tokenize, and the submissions that place each choice
//! — are `request_plane/intake.rs`, whose doc lists all five in order.

use super::super::state::{GatewayShared, Serving};
use super::wire::Api;
use crate::openai::error::{ApiError, ErrorKind};
use crate::openai::request::{GenerationRequest, check_model};
use crate::request_plane::admission::{
    AdmissionVerdict, has_worker, planner_may_act, waits_for_capacity,
};
use crate::request_plane::error::{RequestError, ShedReason};
use crate::request_plane::priority::{CLASS_HEADER, ClassError, Resolved};
use crate::request_plane::router::policy::Policy;
use axum::body::Body;
use axum::http::{HeaderMap, header};
use std::time::{Duration, Instant};

/// A request that passed **parse**: the neutral request, and the class the
/// `x-priority-class` header named, if any (admission judged it before the body was read).
pub(super) struct Parsed {
    pub req: GenerationRequest,
    header: Option<String>,
}

/// **parse**: a class named in the header is judged (admitted) before the body is read; then
/// the body is read (413 past `gateway.max_body_bytes`, 408 past its deadline) and parsed by
/// `api`'s adapter into the neutral request (400 naming the field).
pub(super) async fn parse(
    s: &GatewayShared,
    serving: &Serving,
    api: Api,
    headers: &HeaderMap,
    body: Body,
) -> Result<Parsed, ApiError> {
    let named = class_header(headers)?;
    let header_class = match named {
        Some(h) => serving
            .priority
            .resolve(Some(h), None)
            .map_err(class_error)?,
        None => None,
    };
    admit_class(s, serving, header_class.as_ref())?;
    let bytes = read_body(headers, body, s.max_body_bytes, s.request_body_timeout).await?;
    let req = api.parse(&bytes)?;
    Ok(Parsed {
        req,
        header: named.map(str::to_owned),
    })
}

/// A request that passed **admit**: the neutral request and its class.
pub(super) struct Admitted {
    pub req: GenerationRequest,
    /// Its priority class (the header's, else the body's `priority_class`, else the default).
    pub class: Option<Resolved>,
}

/// **admit**: the request's class is resolved (400 `invalid_priority_class`), and a class
/// known only from the body is judged again as its own (before the body was read it was
/// judged as the highest class would be: [`parse`]). Admission comes before the remaining
/// checks, so that an overloaded fleet sheds a request before anything else is spent on it.
pub(super) fn admit(s: &GatewayShared, serving: &Serving, p: Parsed) -> Result<Admitted, ApiError> {
    let class = serving
        .priority
        .resolve(p.header.as_deref(), p.req.priority_class.as_deref())
        .map_err(class_error)?;
    if p.header.is_none() && class.is_some() {
        admit_class(s, serving, class.as_ref())?;
    }
    Ok(Admitted { req: p.req, class })
}

/// A request that passed **validate**.
pub(super) struct Valid {
    pub req: GenerationRequest,
    pub class: Option<Resolved>,
    /// The routing policy asked for by `x-flotilla-route-policy`.
    pub policy: Option<Policy>,
    /// Its session key (a configured header, or the body's user field when configured).
    pub session: Option<String>,
}

/// **validate**: the model (404), the routing policy header and the session key (400 naming
/// the header or field).
pub(super) fn validate(
    serving: &Serving,
    api: Api,
    headers: &HeaderMap,
    a: Admitted,
) -> Result<Valid, ApiError> {
    check_model(&a.req.model, &[serving.frontend.model_id.as_str()])?;
    let policy = route_policy(headers)?;
    let user_field = match api {
        Api::Messages => "metadata.user_id",
        _ => "user",
    };
    let session = serving
        .sessions
        .key(headers, a.req.user.as_deref(), user_field)?;
    Ok(Valid {
        req: a.req,
        class: a.class,
        policy,
        session,
    })
}

/// Admission under `class`; a refusal of the class names it.
fn admit_class(
    s: &GatewayShared,
    serving: &Serving,
    class: Option<&Resolved>,
) -> Result<(), ApiError> {
    decide(s, serving, class).map_err(|e| name_class(e, class))
}

/// Admission control on this node's flag, this gateway's requests in flight, the fleet view
/// Discovery last published and the prefill queues this node's router published (when one
/// runs here): no call to any actor.
fn decide(
    s: &GatewayShared,
    serving: &Serving,
    class: Option<&Resolved>,
) -> Result<(), RequestError> {
    let fleet = s.fleet.latest();
    let queues = s.prefill_queues.latest();
    // A worker's face queues at its engine like a single server: only draining and the
    // in-flight cap shed there.
    let fleet = if serving.pin.is_some() {
        Some(&[][..])
    } else {
        fleet.as_deref()
    };
    match serving.admission.decide_for(
        s.stats.draining(),
        serving.registry.len(),
        fleet,
        queues.as_deref(),
        class.map(|c| c.level),
    ) {
        AdmissionVerdict::Admit => Ok(()),
        AdmissionVerdict::Shed {
            reason,
            retry_after_s,
        } => {
            metrics::counter!("flotilla_shed_total", "reason" => reason.as_str()).increment(1);
            if let Some(c) = class {
                metrics::counter!("flotilla_class_shed_total", "class" => c.tag.name.clone())
                    .increment(1);
            }
            if reason != crate::request_plane::error::ShedReason::Draining {
                // Demand the fleet could not take: the planner counts it (a draining
                // gateway's refusals go to another gateway and are counted there).
                s.stats.signals().shed();
            }
            Err(RequestError::Overloaded {
                reason,
                retry_after_s,
            })
        }
        AdmissionVerdict::NoFleetView => Err(RequestError::MembershipUnavailable),
    }
}

/// Scale from zero: when no worker serves the model and a planner that acts is in the fleet
/// ([`planner_may_act`]), wait (counted in this gateway's `waiting_for_capacity`, which the
/// planner reads) until one comes up, at most `gateway.cold_start_timeout_ms`; past it, 503
/// with `Retry-After`. Without such a planner, or at a worker's own face, no wait.
pub(super) async fn wait_for_capacity(
    s: &GatewayShared,
    serving: &Serving,
) -> Result<(), RequestError> {
    let Some(fleet) = s.fleet.latest() else {
        return Ok(());
    };
    // Only a planner that acts brings a worker up: without one, a fleet with no worker
    // refuses at once with a 503 instead of waiting, as admission and the router decide.
    if serving.pin.is_some()
        || !waits_for_capacity(&fleet, planner_may_act(&fleet), serving.cold_start_timeout)
    {
        return Ok(());
    }
    let started = Instant::now();
    let _waiting = s.stats.signals().wait_for_capacity();
    let mut view = s.fleet.subscribe();
    tracing::info!(
        timeout_ms = serving.cold_start_timeout.as_millis() as u64,
        "no worker serves the model: the request waits for one to start"
    );
    loop {
        let (up, planner) = match view.borrow_and_update().as_deref() {
            None => (true, true),
            Some(f) => (has_worker(f), planner_may_act(f)),
        };
        if !planner {
            // The planner turned out advisory, or left: nothing will start a worker.
            return Ok(());
        }
        if up {
            let waited = started.elapsed();
            metrics::histogram!("flotilla_cold_start_wait_seconds").record(waited.as_secs_f64());
            tracing::info!(
                waited_ms = waited.as_millis() as u64,
                "a worker came up: the waiting request goes on"
            );
            return Ok(());
        }
        let left = serving.cold_start_timeout.saturating_sub(started.elapsed());
        if left.is_zero() || !matches!(tokio::time::timeout(left, view.changed()).await, Ok(Ok(())))
        {
            let waited_ms = started.elapsed().as_millis() as u64;
            let reason = ShedReason::ColdStart { waited_ms };
            metrics::counter!("flotilla_shed_total", "reason" => reason.as_str()).increment(1);
            s.stats.signals().shed();
            return Err(RequestError::Overloaded {
                reason,
                retry_after_s: 5,
            });
        }
    }
}

/// The priority class named by the `x-priority-class` header, if any (a value that is not
/// visible ASCII, or the header given twice, is refused as a malformed name).
fn class_header(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let mut values = headers.get_all(CLASS_HEADER).iter();
    let Some(v) = values.next() else {
        return Ok(None);
    };
    let malformed = || {
        class_error(ClassError::Malformed {
            source_name: CLASS_HEADER,
        })
    };
    if values.next().is_some() {
        let mut e = malformed();
        e.message = format!("{CLASS_HEADER}: the header is given more than once");
        return Err(e);
    }
    v.to_str().map(Some).map_err(|_| malformed())
}

/// A refusal of a request's class names the class (the shed reason knows only its rank).
fn name_class(e: RequestError, class: Option<&Resolved>) -> ApiError {
    let by_class = matches!(
        e,
        RequestError::Overloaded {
            reason: ShedReason::PriorityClass { .. },
            ..
        }
    );
    let mut api = ApiError::from(e);
    if let Some(c) = class.filter(|_| by_class) {
        api.message = format!("priority class {:?}: {}", c.tag.name, api.message);
    }
    api
}

fn class_error(e: ClassError) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, e.to_string())
        .param(e.param())
        .code("invalid_priority_class")
}

/// The routing policy asked for by the `x-flotilla-route-policy` header, if any.
fn route_policy(headers: &HeaderMap) -> Result<Option<Policy>, ApiError> {
    let Some(v) = headers.get(crate::actors::router::POLICY_HEADER) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.trim().parse::<Policy>().ok())
        .map(Some)
        .ok_or_else(|| {
            ApiError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "header {}: expected one of kv, least_loaded, round_robin, random",
                    crate::actors::router::POLICY_HEADER
                ),
            )
        })
}

/// Read a whole body: 413 past `limit` bytes (without buffering more), 408 when it is not
/// complete within `deadline` (a total deadline, not an inactivity timeout, so a client that
/// trickles bytes cannot hold the request open either). A body with a `Content-Encoding` arrives
/// here decoded (`edge/encoding.rs`): `limit` counts decoded bytes, and a body that does not
/// decode is a 400 naming its encoding.
pub(in crate::actors::gateway) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    deadline: Duration,
) -> Result<axum::body::Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            ErrorKind::PayloadTooLarge,
            format!("request body exceeds the limit of {limit} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if is_length_limit(&e) => Err(too_large()),
        Ok(Err(e)) => match decode_error(&e) {
            Some(d) => {
                tracing::debug!(error = %d, "request body not decodable");
                let detail: String = d.source.to_string().chars().take(200).collect();
                let coding = d.coding.as_str();
                Err(ApiError::new(
                    ErrorKind::InvalidRequest,
                    format!(
                        "the request body is not valid {coding} data (Content-Encoding: \
                         {coding}): {detail}"
                    ),
                )
                .code("invalid_content_encoding"))
            }
            None => {
                tracing::debug!(error = %e, "request body unreadable");
                Err(ApiError::new(
                    ErrorKind::InvalidRequest,
                    "the request body could not be read",
                ))
            }
        },
        Err(_) => {
            metrics::counter!("flotilla_http_body_timeouts_total").increment(1);
            Err(ApiError::new(
                ErrorKind::RequestTimeout,
                format!(
                    "the request body was not received within {} ms",
                    deadline.as_millis()
                ),
            ))
        }
    }
}

/// The decoding error inside a body error, if it is one.
fn decode_error(e: &axum::Error) -> Option<&crate::actors::gateway::edge::encoding::DecodeError> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = src {
        if let Some(d) = err.downcast_ref::<crate::actors::gateway::edge::encoding::DecodeError>() {
            return Some(d);
        }
        src = err.source();
    }
    None
}

/// Whether a body error is `to_bytes`'s length limit.
fn is_length_limit(e: &axum::Error) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = src {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        src = err.source();
    }
    false
}

#[cfg(test)]
mod tests;
