def is_kvc(path):
    return False
