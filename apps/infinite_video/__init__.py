"""∞-Video demo: question answering over a whole video through a continuous long-term memory."""
