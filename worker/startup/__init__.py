"""A worker's start: the model loaded once and its start-up checks, remembered."""
