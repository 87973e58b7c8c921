"""What is built on the runtime; the runtime never imports it.

    plan/     the planners: what a run would need and how fast it would go, on paper, before launch
    cli/      the `zerodp` command: train, estimate, consolidate
    app/      the `zerodp train` application (only cli imports it)
    models/   models bundled with zerodp (the GPT `zerodp train` trains), importable as library models
"""
