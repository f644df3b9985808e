"""Streaming speaker diarization (streaming Sortformer), batched over streams; see docs/diarization.md."""
