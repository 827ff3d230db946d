"""Admission: a generation checked and built into a Request, chat templates, a caller's budget."""
