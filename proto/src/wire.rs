//! Frames on the agent socket: a 4-byte big-endian length, then that many bytes of JSON.
//!
//! Requests are wrapped in an [`Envelope`] that carries [`crate::PROTO_VERSION`]. Lengths above
//! [`MAX_FRAME`] are refused before anything is allocated, so a hostile peer cannot make the agent
//! (root) allocate unbounded memory.

use crate::PROTO_VERSION;
use crate::msg::{Request, Response};
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Largest frame accepted in either direction.
pub const MAX_FRAME: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    pub version: u32,
    pub request: Request,
}

impl Envelope {
    pub fn new(request: Request) -> Self {
        Envelope {
            version: PROTO_VERSION,
            request,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes is larger than the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error(
        "protocol version {got} is not supported (this side speaks {PROTO_VERSION}); install matching sluice versions of the plugin, agent and CLI"
    )]
    Version { got: u32 },
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// Decodes the 4-byte length header; refuses oversized frames.
pub fn frame_len(header: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len)
}

/// Encodes a value as one frame (header + body).
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(value).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes a request body, checking the version before the request itself so that a future
/// request shape is reported as a version mismatch, not as garbage.
pub fn decode_request(body: &[u8]) -> Result<Request, FrameError> {
    #[derive(Deserialize)]
    struct VersionOnly {
        version: u32,
    }
    let v: VersionOnly =
        serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if v.version != PROTO_VERSION {
        return Err(FrameError::Version { got: v.version });
    }
    let env: Envelope =
        serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))?;
    Ok(env.request)
}

pub fn decode_response(body: &[u8]) -> Result<Response, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Blocking read of one frame body.
pub fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; 4];
    r.read_exact(&mut header)?;
    let len = frame_len(header)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

pub fn write_frame<T: Serialize>(w: &mut impl Write, value: &T) -> Result<(), FrameError> {
    w.write_all(&encode(value)?)?;
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let frame = encode(&Envelope::new(Request::Status)).unwrap();
        let body = read_frame(&mut &frame[..]).unwrap();
        assert_eq!(decode_request(&body).unwrap(), Request::Status);
    }

    #[test]
    fn refuses_oversized_and_foreign_frames() {
        assert!(matches!(
            frame_len(u32::MAX.to_be_bytes()),
            Err(FrameError::TooLarge(_))
        ));
        let e = decode_request(br#"{"version":99,"request":{"op":"status"}}"#).unwrap_err();
        assert!(e.to_string().contains("version 99 is not supported"), "{e}");
        assert!(matches!(
            decode_request(b"{\"version\":1,\"request\":{\"op\":\"nope\"}}"),
            Err(FrameError::Malformed(_))
        ));
        assert!(matches!(
            decode_request(b"\xff\x00"),
            Err(FrameError::Malformed(_))
        ));
    }
}
