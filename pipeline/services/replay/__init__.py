"""Fan-out and replay (DESIGN.md section 6): import/export, the shipper, projection rebuilds,
the log checker and the readable renderer behind ``tail`` and transcripts.

Modules: :mod:`.topic` (a session topic read whole, records built for publishing),
:mod:`.transfer` (import and export of session files), :mod:`.ship` (the directory
shipper), :mod:`.check` (the fsck), :mod:`.rebuild` (versioned projection rebuilds and the
active-version pointer) and :mod:`.render` (terminal rendering of events).
"""
