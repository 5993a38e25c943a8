"""The teacher's summary of a class: ``python -m gclip.classroom DIR``.

Each student saves the judge's verdict on their file as JSON (``python -m
gclip.conformance lab/my_clip.py:clip_shards --json > alice.json``, or with
``--ranks 4`` on the files of ``lab/distributed/``); the teacher collects the
files in one folder. The summary reads every ``*.json`` there (a student is
the file's name) and prints who passed, the bug the judge found in each
failing function (its fingerprint, counted over the class), and the common
mistakes: the checks most students failed, and on real ranks what the ranks
did (entered no collective, did not finish). ``--json``: the same as one
JSON object. A file that is not a verdict is listed as such, never skipped in
silence.
"""

from .summary import Student, main, read_class, summarize

__all__ = ["Student", "main", "read_class", "summarize"]
