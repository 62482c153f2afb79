"""`ringtrain prepare`: corpora tokenized on Ray Data into the prepared dataset format (``ringtrain.prepared``)."""
