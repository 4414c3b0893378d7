//! The agent's frame decoder, fed raw socket bytes: a 4-byte big-endian length, then a JSON body
//! (`sluice_proto::wire`). The agent runs as root and reads frames from any local user.
//!
//! Properties: never panics; a length header above `MAX_FRAME` is refused having read only the
//! header (nothing is allocated for it); a body that is read is at most `MAX_FRAME` bytes; a decoded
//! request encodes again to a frame that decodes to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::wire::{self, Envelope, FrameError, MAX_FRAME};
use std::io::Read;

/// Counts the bytes the decoder pulled from the "socket".
struct Counting<'a> {
    data: &'a [u8],
    read: usize,
}

impl Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.data.len() - self.read);
        buf[..n].copy_from_slice(&self.data[self.read..self.read + n]);
        self.read += n;
        Ok(n)
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() >= 4 {
        let header: [u8; 4] = data[..4].try_into().unwrap();
        let claimed = u32::from_be_bytes(header) as usize;
        match wire::frame_len(header) {
            Ok(n) => assert!(n == claimed && n <= MAX_FRAME),
            Err(FrameError::TooLarge(n)) => assert!(n == claimed && n > MAX_FRAME),
            Err(e) => panic!("frame_len: unexpected {e}"),
        }
    }
    let mut src = Counting { data, read: 0 };
    match wire::read_frame(&mut src) {
        Ok(body) => {
            assert!(body.len() <= MAX_FRAME);
            if let Ok(req) = wire::decode_request(&body) {
                let again = wire::encode(&Envelope::new(req.clone())).expect("re-encode");
                let body2 = wire::read_frame(&mut &again[..]).expect("re-read");
                assert_eq!(wire::decode_request(&body2).expect("re-decode"), req);
            }
            let _ = wire::decode_response(&body);
        }
        Err(FrameError::TooLarge(_)) => assert_eq!(src.read, 4, "read past an oversized header"),
        Err(_) => {}
    }
    // The body alone, as if framing had been right.
    let _ = wire::decode_request(data);
});
