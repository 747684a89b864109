from apps.hub import main

if __name__ == "__main__":
    main(app="querent")
