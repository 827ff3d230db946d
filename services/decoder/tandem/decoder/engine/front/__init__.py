"""The fronts: the Engine (in process and asyncio), the engine thread, events to an event loop."""
