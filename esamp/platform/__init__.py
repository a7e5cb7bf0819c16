"""Facts about the machine every package may ask: devices (``devices``), GPU memory (``gpu``), CPU
threads (``threads``). Imports nothing of esamp's engines."""
