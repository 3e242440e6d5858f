"""Client-side helpers: what turns conversations into token ids lives here, outside the runtime core."""
