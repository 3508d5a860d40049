"""Config presets (ml_collections files loaded with --config=configs/<name>.py[:variant])."""
