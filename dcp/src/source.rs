//! Random-access byte sources: the one I/O seam the DCP reader needs.

use std::fs::File;
use std::io;

/// Bytes that can be read at any offset (a file, a slice of a file, an in-memory buffer, an
/// object-store range). Reads are exact: a short read is an `UnexpectedEof` error.
pub trait ReadAt {
    /// Total length in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` with the bytes at `offset..offset + buf.len()`.
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// Reads `len` bytes at `offset` into a new buffer, after checking they exist.
    fn read_vec(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let end = offset.checked_add(len).filter(|e| *e <= self.size());
        if end.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "range {offset}..{} is past the end ({} bytes)",
                    offset.saturating_add(len),
                    self.size()
                ),
            ));
        }
        let len = usize::try_from(len).map_err(|_| io::Error::other("range too large"))?;
        let mut buf = vec![0u8; len];
        self.read_exact_at(offset, &mut buf)?;
        Ok(buf)
    }
}

impl ReadAt for [u8] {
    fn size(&self) -> u64 {
        self.len() as u64
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| eof())?;
        let end = start.checked_add(buf.len()).ok_or_else(eof)?;
        let src = self.get(start..end).ok_or_else(eof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl ReadAt for Vec<u8> {
    fn size(&self) -> u64 {
        self.len() as u64
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.as_slice().read_exact_at(offset, buf)
    }
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end")
}

/// `len` bytes of a file starting at `start` (one DCP item inside a `.distcp` file).
#[derive(Debug, Clone, Copy)]
pub struct FileSlice<'a> {
    pub file: &'a File,
    pub start: u64,
    pub len: u64,
}

impl ReadAt for FileSlice<'_> {
    fn size(&self) -> u64 {
        self.len
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64).ok_or_else(eof)?;
        if end > self.len {
            return Err(eof());
        }
        read_file_at(self.file, self.start + offset, buf)
    }
}

/// A positional read of a whole file.
impl ReadAt for File {
    fn size(&self) -> u64 {
        self.metadata().map(|m| m.len()).unwrap_or(0)
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        read_file_at(self, offset, buf)
    }
}

#[cfg(unix)]
fn read_file_at(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(windows)]
fn read_file_at(file: &File, mut offset: u64, mut buf: &mut [u8]) -> io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset)? {
            0 => return Err(eof()),
            n => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}
