//! DFX: trace files (writing and reading) and the analyses over them.
