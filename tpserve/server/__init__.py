"""The server: config, CLI, HTTP API, engine, scheduler, block manager."""
