"""The coordinator: stream consumer, rq tasks and worker loop, settings, status; the perseus CLI."""
