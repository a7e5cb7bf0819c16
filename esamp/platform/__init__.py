"""Facts about the machine every package may ask: devices (``devices``), GPU memory (``gpu``), CPU
threads (``threads``); and one HTTP request with asyncio (``http_client``). Imports nothing of
esamp's engines."""
