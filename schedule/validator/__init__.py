"""The pieces of `amk.schedule.validate`: structure, ordering and race analysis."""
