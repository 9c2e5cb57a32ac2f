//! A bounds-checked big-endian cursor over one message. Every read checks the remaining length
//! first; lengths from the wire are converted with `try_from`, never `as`.

use super::DecodeError;
use std::ops::Range;

pub(super) struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    pub(super) fn offset(&self) -> usize {
        self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let remaining = self.data.len() - self.pos;
        if n > remaining {
            return Err(DecodeError::Truncated {
                offset: self.pos,
                needed: n - remaining,
            });
        }
        let out = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    pub(super) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(super) fn i32(&mut self) -> Result<i32, DecodeError> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// An Int16 count (column counts): negative is an error.
    pub(super) fn i16_len(&mut self) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let b = self.take(2)?;
        let n = i16::from_be_bytes([b[0], b[1]]);
        usize::try_from(n).map_err(|_| DecodeError::NegativeLength {
            offset,
            len: i64::from(n),
        })
    }

    /// An Int32 length followed by that many bytes; returns their range in the message.
    pub(super) fn len_prefixed(&mut self) -> Result<Range<usize>, DecodeError> {
        let offset = self.pos;
        let n = self.i32()?;
        let n = usize::try_from(n).map_err(|_| DecodeError::NegativeLength {
            offset,
            len: i64::from(n),
        })?;
        let start = self.pos;
        self.take(n)?;
        Ok(start..start + n)
    }

    /// A NUL-terminated UTF-8 string.
    pub(super) fn cstr(&mut self) -> Result<&'a str, DecodeError> {
        let offset = self.pos;
        let rest = &self.data[self.pos..];
        let nul = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString { offset })?;
        let s =
            std::str::from_utf8(&rest[..nul]).map_err(|_| DecodeError::InvalidUtf8 { offset })?;
        self.pos += nul + 1;
        Ok(s)
    }

    /// Checks that the whole message was consumed.
    pub(super) fn finish(&self) -> Result<(), DecodeError> {
        match self.data.len() - self.pos {
            0 => Ok(()),
            trailing => Err(DecodeError::TrailingBytes { trailing }),
        }
    }
}
