"""Helpers shared by the lab (demo, trainer, judge, bench): not part of the public API."""
