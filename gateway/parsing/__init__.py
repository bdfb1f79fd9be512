"""Untrusted files parsed outside the gateway's process (SPEC §9): HTML pages, PDFs and
images are read by a child process under a CPU, memory and wall-clock limit
(`jobs.py` runs one; `child.py` is that process; `html_text.py`, `pdf_text.py` and
`image_scale.py` are the jobs; `readers.py` is what tools and media call).

Kept to this one small class: the child imports the package first, and pays for every
import here."""


class Unreadable(Exception):
    """A job's clear refusal of its input (an encrypted or damaged PDF, say); `str(exc)`
    says why, in words for the model."""
