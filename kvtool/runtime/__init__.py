"""What runs a model over a document: model loading, settings, prompt, documents, session, .kvc store,
memory plan."""
