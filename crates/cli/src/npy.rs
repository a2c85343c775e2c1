//! NPY v1.0 writer for fp32 arrays (`numpy.load` reads the files): the magic, the version, a
//! little-endian header length, a Python dict literal padded with spaces to a multiple of 64
//! bytes and ending in a newline, then the little-endian data in C order.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};

/// The file's bytes up to the data.
fn header(shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    // magic (6) + version (2) + header length (2) + dict + '\n' is a multiple of 64.
    let unpadded = 10 + dict.len() + 1;
    dict.extend(std::iter::repeat_n(
        ' ',
        unpadded.next_multiple_of(64) - unpadded,
    ));
    dict.push('\n');
    let mut out = Vec::with_capacity(10 + dict.len());
    out.extend_from_slice(b"\x93NUMPY");
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Writes `data` (row-major, `shape.iter().product()` values) to `path` as `<f4`.
pub(crate) fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    if shape.iter().product::<usize>() != data.len() {
        bail!("npy: {} values for shape {shape:?}", data.len());
    }
    let h = header(shape);
    if h.len() > 10 + u16::MAX as usize {
        bail!("npy: header too long for format 1.0");
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("making {}", dir.display()))?;
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    w.write_all(&h)?;
    for v in data {
        w.write_all(&v.to_le_bytes())?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses what `write_f32` wrote: `(shape text, values)`.
    fn read(bytes: &[u8]) -> (String, Vec<f32>) {
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        assert_eq!(&bytes[6..8], &[1, 0]);
        let n = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + n) % 64, 0, "header not padded to 64 bytes");
        let dict = std::str::from_utf8(&bytes[10..10 + n]).unwrap();
        assert!(dict.ends_with('\n'));
        assert!(dict.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': ("));
        let shape =
            dict[dict.find("'shape': ").unwrap() + 9..dict.find(", }").unwrap()].to_string();
        let values = bytes[10 + n..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (shape, values)
    }

    #[test]
    fn npy_files_have_an_aligned_header_and_le_data() {
        let dir = std::env::temp_dir().join(format!("simpler-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.npy");
        let data: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        write_f32(&path, &[2, 3], &data).unwrap();
        let (shape, values) = read(&std::fs::read(&path).unwrap());
        assert_eq!(shape, "(2, 3)");
        assert_eq!(values, data);
        write_f32(&path, &[4], &data[..4]).unwrap();
        assert_eq!(read(&std::fs::read(&path).unwrap()).0, "(4,)");
        assert!(write_f32(&path, &[4, 4], &data).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
