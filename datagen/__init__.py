"""Label generation: run draft and target, write labelled datasets."""
