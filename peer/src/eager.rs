//! Requests that end with their last DATA frame.
//!
//! tonic encodes a request as a body that learns it has ended only when polled once more
//! after its one message, so hyper sends that message in a DATA frame and then an empty DATA
//! frame with END_STREAM; the owner's unary handler waits for the second. [`EagerEnd`] looks
//! one frame ahead, so a body whose next poll already says "ended" reports it with the
//! message and hyper sets END_STREAM on the message's own frame: one frame fewer per request,
//! and the owner's handler starts when the message arrives.

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body as _, Frame, SizeHint};
use tonic::body::Body;
use tonic::codegen::{http, Bytes, Service};
use tonic::transport::Channel;
use tonic::Status;

/// A request body that reports its end together with its last frame when that is known
/// without waiting (see the module).
pub(crate) struct EagerEnd {
    inner: Body,
    /// A frame (or error) polled ahead, answered next.
    ahead: Option<Result<Frame<Bytes>, Status>>,
    /// The inner body has ended.
    ended: bool,
}

impl EagerEnd {
    pub(crate) fn new(inner: Body) -> Self {
        Self { inner, ahead: None, ended: false }
    }

    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.ended = true;
        }
        polled
    }
}

impl http_body::Body for EagerEnd {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let frame = match this.ahead.take() {
            Some(f) => f,
            None => match this.poll_inner(cx) {
                Poll::Ready(Some(f)) => f,
                other => return other,
            },
        };
        if frame.is_ok() {
            // Pending leaves the next frame to the next poll (the inner body has the waker).
            if let Poll::Ready(next) = this.poll_inner(cx) {
                this.ahead = next;
            }
        }
        Poll::Ready(Some(frame))
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_none() && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match &self.ahead {
            None => self.inner.size_hint(),
            // A frame polled ahead: its length is no longer in the inner body's hint.
            Some(_) => SizeHint::default(),
        }
    }
}

/// A [`Channel`] whose requests end with their last DATA frame ([`EagerEnd`]).
#[derive(Clone, Debug)]
pub(crate) struct EagerEndChannel(pub(crate) Channel);

impl Service<http::Request<Body>> for EagerEndChannel {
    type Response = <Channel as Service<http::Request<Body>>>::Response;
    type Error = <Channel as Service<http::Request<Body>>>::Error;
    type Future = <Channel as Service<http::Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::<http::Request<Body>>::poll_ready(&mut self.0, cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        self.0.call(request.map(|b| Body::new(EagerEnd::new(b))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    /// A body like tonic's: it learns it has ended only when polled after its last frame.
    fn frames(data: &[&'static [u8]], then_error: bool) -> Body {
        let mut items: Vec<Result<Frame<Bytes>, Status>> =
            data.iter().map(|d| Ok(Frame::data(Bytes::from_static(d)))).collect();
        if then_error {
            items.push(Err(Status::internal("encoding failed")));
        }
        Body::new(StreamBody::new(tokio_stream::iter(items)))
    }

    async fn next(b: &mut EagerEnd) -> Option<Result<Bytes, Status>> {
        b.frame().await.map(|f| f.map(|f| f.into_data().expect("a data frame")))
    }

    #[tokio::test]
    async fn a_body_ends_with_its_last_frame_and_keeps_every_frame_and_error() {
        // What tonic gives hyper without the look-ahead: the end is known one poll late.
        let plain = frames(&[b"grant"], false);
        assert!(!plain.is_end_stream());

        let mut one = EagerEnd::new(frames(&[b"grant"], false));
        assert!(!one.is_end_stream());
        assert_eq!(next(&mut one).await.unwrap().unwrap(), "grant");
        assert!(one.is_end_stream(), "ended with its one frame");
        assert!(next(&mut one).await.is_none());

        let mut two = EagerEnd::new(frames(&[b"a", b"b"], false));
        assert_eq!(next(&mut two).await.unwrap().unwrap(), "a");
        assert!(!two.is_end_stream(), "a frame follows");
        assert_eq!(next(&mut two).await.unwrap().unwrap(), "b");
        assert!(two.is_end_stream());
        assert!(next(&mut two).await.is_none());

        // An error after a frame is answered after it, and the body is not taken as ended.
        let mut failing = EagerEnd::new(frames(&[b"a"], true));
        assert_eq!(next(&mut failing).await.unwrap().unwrap(), "a");
        assert!(!failing.is_end_stream());
        assert_eq!(next(&mut failing).await.unwrap().unwrap_err().message(), "encoding failed");

        let mut empty = EagerEnd::new(frames(&[], false));
        assert!(next(&mut empty).await.is_none());
        assert!(empty.is_end_stream());
    }
}
