"""``python -m gclip.classroom DIR``: the teacher's summary of the judge's verdicts."""

from . import main

if __name__ == "__main__":
    main()
