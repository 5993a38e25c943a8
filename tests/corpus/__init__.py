"""Real clipping code, transcribed from public projects, for the judge to grade (tests/test_corpus.py)."""
