//! The metrics listener (`--metrics-addr`): `GET /metrics` (the Prometheus exposition),
//! `GET /healthz` (liveness: the process answers) and `GET /readyz` (readiness: 200 when
//! accepting engine work, 503 otherwise, the `ctl health --json` object as body). Served by
//! hyper on the `orbitkv-metrics` thread (a tokio current-thread runtime), never on a shard.
//!
//! One request per connection. A client that sends nothing gets closed after
//! [`HEADER_DEADLINE`], one that does not read its answer after [`CONNECTION_DEADLINE`];
//! garbage gets hyper's `400`; past [`MAX_CONNECTIONS`] at once a connection is closed
//! unanswered. None of them holds up other scrapes or the server.

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::Semaphore;

use super::{exposition, starting_exposition, Sample};
use crate::control::shared::Shared;
use crate::control::startup::Startup;

/// Connections served at once.
const MAX_CONNECTIONS: usize = 32;
/// Time a client has to send its request's head.
const HEADER_DEADLINE: Duration = Duration::from_secs(5);
/// Time a connection may take in all (a client that does not read its answer).
const CONNECTION_DEADLINE: Duration = Duration::from_secs(15);
/// Samples taken at once (each waits up to 2 s for a shard that does not answer).
const SAMPLERS: usize = 4;

/// The exposition's content type (OpenMetrics text, which Prometheus reads).
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Binds `addr` (before the server starts serving, so that an address in use stops it).
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The `orbitkv-metrics` thread: serves `listener` until the process ends.
pub(crate) fn serve(listener: TcpListener, startup: Arc<Startup>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(SAMPLERS)
        .thread_name("orbitkv-sample")
        .build();
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "the metrics listener has no runtime; metrics are off");
            return;
        }
    };
    runtime.block_on(accept(listener, startup));
}

async fn accept(listener: TcpListener, startup: Arc<Startup>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "the metrics listener failed; metrics are off");
            return;
        }
    };
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!("metrics connection closed unanswered: too many at once");
            continue;
        };
        let startup = Arc::clone(&startup);
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request| answer(request, Arc::clone(&startup)));
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_DEADLINE, connection).await {
                Ok(Err(e)) => tracing::debug!(error = %e, "metrics connection failed"),
                Err(_) => tracing::debug!("metrics connection closed after its deadline"),
                Ok(Ok(())) => {}
            }
            drop(slot);
        });
    }
}

async fn answer(
    request: Request<Incoming>,
    startup: Arc<Startup>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n".into());
        r.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(r);
    }
    let server = startup.server().map(|(shared, _)| Arc::clone(shared));
    Ok(match (request.uri().path(), server) {
        ("/healthz", _) => text(StatusCode::OK, "ok\n".into()),
        // Starting: not ready, and how far along; the exposition says the same in numbers.
        ("/readyz", None) => json(StatusCode::SERVICE_UNAVAILABLE, &startup.health()),
        ("/metrics", None) => {
            let mut r = text(StatusCode::OK, starting_exposition(&startup));
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(OPENMETRICS));
            r
        }
        ("/readyz", Some(shared)) => match sampled(shared, &startup, |s| s.health()).await {
            Some(health) => {
                let status =
                    if health.ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
                json(status, &health)
            }
            None => {
                text(StatusCode::INTERNAL_SERVER_ERROR, "no sample (see the server log)\n".into())
            }
        },
        ("/metrics", Some(shared)) => match sampled(shared, &startup, exposition).await {
            Some(body) => {
                let mut r = text(StatusCode::OK, body);
                r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(OPENMETRICS));
                r
            }
            None => {
                text(StatusCode::INTERNAL_SERVER_ERROR, "no sample (see the server log)\n".into())
            }
        },
        (other, _) => text(
            StatusCode::NOT_FOUND,
            format!("no {other:?} here: /metrics, /healthz and /readyz are\n"),
        ),
    })
}

/// Takes a sample off the runtime's thread (it may wait for the shards) and makes `f` of it.
async fn sampled<T: Send + 'static>(
    shared: Arc<Shared>,
    startup: &Arc<Startup>,
    f: impl FnOnce(Sample) -> T + Send + 'static,
) -> Option<T> {
    let startup = Arc::clone(startup);
    match tokio::task::spawn_blocking(move || f(Sample::take(&shared, &startup))).await {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::error!(error = %e, "taking a metrics sample failed");
            None
        }
    }
}

/// `body` as JSON (through a JSON value, whose members are sorted, as the admin socket's).
fn json(status: StatusCode, body: &impl serde::Serialize) -> Response<Full<Bytes>> {
    let body = serde_json::to_value(body).expect("health replies serialize to JSON");
    let mut r = text(status, format!("{body}\n"));
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}
