"""``python -m pipeline.codec.native_pyx``: rewrite ``pipeline/codec/_native_events.pyx``, the
Cython source of today's session-event decoder (:mod:`pipeline.codec.binary_native`), after
a change to the schema or to the code generator; a reinstall then compiles it."""

from __future__ import annotations

import sys

from pipeline.codec.binary_native import PYX_FILE, native_source
from pipeline.codec.schemas import current_event_schema


def main() -> None:
    binary = current_event_schema().binary
    decoder = binary.python_decoder
    text = native_source(binary.decoder_source, decoder.__globals__, decoder.__name__)
    if text is None:
        sys.exit("today's session-event schema is recursive: not compiled")
    PYX_FILE.write_text(text, encoding="utf-8")
    print(f"wrote {PYX_FILE}")


if __name__ == "__main__":
    main()
